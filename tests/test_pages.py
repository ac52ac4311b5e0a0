"""Packed weights on 2 MB pages (tr_core/speed/pages.py): fresh mappings advised for transparent huge pages inside
``huge_pages()`` where the system offers them, plain ``torch.empty`` elsewhere; the tiles' bits the same either way."""

import gc
from pathlib import Path

import pytest
import torch

from tr_core.speed import layouts, pages


def mapping_of(address: int) -> tuple[str, list[str]] | None:
    """The /proc/self/smaps entry holding ``address``: its first line and its VmFlags."""
    current, flags = None, None
    for line in open("/proc/self/smaps").read().splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            current = line if lo <= address < hi else None
        elif head == "VmFlags:" and current is not None:
            flags = line.split()[1:]
            return current, flags
    return None


needs_thp = pytest.mark.skipif(not pages.available(),
                               reason=f"no transparent huge pages here ({pages.mode()}): empty is torch.empty")


def test_outside_the_block_empty_is_torch_empty(monkeypatch):
    # what the code does: no advised mapping made, outside the block or where the system has no huge pages (the flags
    # of the memory malloc gives are not checked: the fast tier once found the process's [heap] itself marked for
    # huge pages, by other code)
    made, advise = [], pages._mapping
    monkeypatch.setattr(pages, "_mapping", lambda size: made.append(size) or advise(size))
    t = pages.empty((700, 1024), torch.float32)
    assert t.shape == (700, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    assert not made
    monkeypatch.setattr(pages, "available", lambda: False)
    with pages.huge_pages():
        u = pages.empty((700, 1024), torch.float32)
    assert u.shape == (700, 1024) and not made


@needs_thp
def test_inside_the_block_tensors_share_advised_chunks_on_page_boundaries():
    with pages.huge_pages():
        a = pages.empty((1000, 8, 32, 2), torch.bfloat16)  # 1 MB
        b = pages.empty((3, 5), torch.float32)
        big = pages.empty((5000, 1024), torch.float32)  # 20 MB: a mapping of its own
    for t in (a, b, big):
        assert t.data_ptr() % 4096 == 0 and t.is_contiguous()
        entry, flags = mapping_of(t.data_ptr())
        assert "hg" in flags, entry  # advised (MADV_HUGEPAGE)
    assert b.data_ptr() == a.data_ptr() + a.numel() * 2  # the next page boundary of the same chunk
    assert big.data_ptr() % pages.HUGE == 0
    a.fill_(1.5)
    b.copy_(torch.arange(15.0).view(3, 5))
    assert float(a.float().sum()) == 1.5 * a.numel() and b[2, 4] == 14.0
    assert pages.huge_share([a, b, big])[1] == a.numel() * 2 + 15 * 4 + big.numel() * 4


@needs_thp
def test_a_mapping_is_let_go_with_the_last_tensor_in_it():
    with pages.huge_pages():
        big = pages.empty((5000, 1024), torch.float32)
    view = big[10:20]
    address = big.data_ptr()
    del big
    gc.collect()
    assert mapping_of(address) is not None  # the view keeps it
    view.fill_(2.0)
    del view
    gc.collect()
    found = mapping_of(address)
    assert found is None or "hg" not in found[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_tiles_packed_on_huge_pages_have_the_same_bits(dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 45, generator=g)
    plain = layouts.weight_tiles(w, dtype)
    with pages.huge_pages():
        placed = layouts.weight_tiles(w, dtype)
    assert torch.equal(plain.tiles.view(torch.uint8 if dtype != torch.float32 else torch.int32),
                       placed.tiles.view(torch.uint8 if dtype != torch.float32 else torch.int32))
    assert placed.tiles.is_contiguous() and placed.tiles.shape == plain.tiles.shape


def test_the_share_on_huge_pages_is_read_from_the_process_own_mappings(monkeypatch, tmp_path):
    smaps = tmp_path / "smaps"
    smaps.write_text("7f0000000000-7f0000800000 rw-p 00000000 00:00 0\nSize: 8192 kB\nAnonHugePages: 4096 kB\n"
                     "7f0000800000-7f0000900000 rw-p 00000000 00:00 0\nAnonHugePages: 0 kB\n")
    monkeypatch.setattr(pages, "Path", lambda p: smaps if p == "/proc/self/smaps" else Path(p))

    class Span:  # a tensor's address and size, as huge_share reads them
        def __init__(self, at, size):
            self.at, self.size = at, size

        def data_ptr(self):
            return self.at

        def numel(self):
            return self.size

        def element_size(self):
            return 1

    # 6 MB inside the mapping with 4 MB of huge pages (at most 4 counted), 1 MB in the one without
    on, total = pages.huge_share([Span(0x7f0000000000, 6 << 20), Span(0x7f0000800000, 1 << 20)])
    assert (on, total) == (4 << 20, 7 << 20)


@pytest.mark.skipif("native" not in layouts.available_layouts(), reason="no C linear layer built here")
@torch.inference_mode()
def test_a_plan_s_native_tiles_are_packed_on_advised_pages_and_the_summary_says_how_many(monkeypatch):
    from conftest import tiny_model

    from tr_core.speed import chooser, kernels
    from tr_core.speed.layouts import linear_shapes, make_plan

    def prepared():
        model = tiny_model("llama", dtype=torch.float32)
        counts = {s: len(ls) for s, ls in linear_shapes(model).items()}
        t = {(s, r, n): 1.0 if n == "native" else 2.0 for s in counts for r in (1, 4) for n in ("linear", "native")}
        chooser.prepare_model(model, "exact", plan=make_plan("exact", t, counts, ("linear", "native")))
        return model

    placed = prepared()
    tiles = kernels.packed_tensors(placed)
    assert tiles and all(t.dtype == torch.float32 and t.is_contiguous() for t in tiles)
    if pages.available():
        assert all("hg" in mapping_of(t.data_ptr())[1] for t in tiles)
    monkeypatch.setattr(pages, "huge_share", lambda ts: (sum(t.numel() * 4 for t in ts) // 2,
                                                         sum(t.numel() * 4 for t in ts)))
    monkeypatch.setattr(pages, "mode", lambda: "madvise")
    total = sum(t.numel() * 4 for t in tiles)
    assert kernels.kernel_summary(placed).endswith(
        f"; packed weights on 2 MB pages: {total // 2 / 1e6:.0f} of {total / 1e6:.0f} MB (the system's transparent "
        "huge pages: madvise)")
    monkeypatch.setattr(pages, "available", lambda: False)  # the same model on 4 kB pages: the same numbers
    made, advise = [], pages._mapping
    monkeypatch.setattr(pages, "_mapping", lambda size: made.append(size) or advise(size))
    plain = prepared()
    # no mapping advised for it, and none of its tiles in the mappings of the placed model's (the flags of the memory
    # the allocator gives are not checked: after many other tests the suite once found a tile of this model on memory
    # marked for huge pages, not by this code; the likeliest reason, unconfirmed, is other code's MADV_HUGEPAGE on a
    # buffer it later freed to malloc, which keeps its mark)
    advised = [mapping_of(t.data_ptr())[0].split(None, 1)[0].split("-") for t in tiles] if pages.available() else []
    spans = [(int(lo, 16), int(hi, 16)) for lo, hi in advised]
    assert not made
    assert not any(lo <= t.data_ptr() < hi for t in kernels.packed_tensors(plain) for lo, hi in spans)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    assert torch.equal(placed(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_where_the_system_refuses_the_advice_the_memory_still_serves(monkeypatch):
    """A kernel or sandbox may answer MADV_HUGEPAGE with an error: the tensor is made all the same (on 4 kB
    pages), so a model still prepares."""
    import mmap

    class Refusing(mmap.mmap):
        def madvise(self, *args):
            raise OSError(22, "Invalid argument")

    monkeypatch.setattr(pages.mmap, "mmap", Refusing)
    monkeypatch.setattr(pages, "available", lambda: True)
    monkeypatch.setattr(pages, "_chunk", [None, 0, 0])  # a fresh chunk, so a mapping is made (and advised) now
    with pages.huge_pages():
        t = pages.empty((1000, 300), torch.float32)
    t.fill_(3.0)
    assert t.shape == (1000, 300) and float(t.sum()) == 3.0 * t.numel()

"""Packed weights on 2 MB pages (Linux's transparent huge pages), where the system offers them.

A step streams every packed weight once (~270 MB for the embedded model in bf16). On 4 kB pages that is ~66,000
pages a step, each a translation the CPU must look up (its TLB holds a few thousand) and a boundary its hardware
prefetcher stops at; on 2 MB pages, ~135. Where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or
``madvise``, tensors made by ``empty`` inside ``huge_pages()`` come from fresh anonymous mappings advised for huge
pages (``MADV_HUGEPAGE``) before anything is written to them, so the kernel gives them 2 MB pages as they are first
written. Measured on the 2-vCPU AMD EPYC (docs/speed.md): a step's linear calls alone, the same bits, 0.90-0.96x
the time on 4 kB pages at 1-24 rows. Elsewhere (another OS, huge pages off) ``empty`` is ``torch.empty``.

The mappings are chunks of ``CHUNK`` bytes, each handed out front to back (a larger tensor gets a mapping of its
own); a chunk is unmapped when the last tensor in it is gone (each holds it through numpy's buffer export). Only what
is written gets memory: a chunk's unused tail costs at most the one 2 MB page it starts in.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

HUGE = 2 << 20  # bytes of a huge page (x86-64 and arm64 with 4 kB base pages)
CHUNK = 64 << 20  # bytes of a mapping that small tensors share
ALIGN = 4096  # where each tensor starts within a chunk
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

_lock = threading.Lock()
_local = threading.local()  # .on: inside huge_pages() on this thread
# the chunk being handed out: a weak reference to the uint8 array over its whole mapping (numpy makes every view of
# it a view of that array, so the tensors in the chunk keep it alive, not this), where the chunk starts in it, and
# its next offset
_chunk: list = [None, 0, 0]


def mode() -> str:
    """The system's transparent huge pages setting (``always``, ``madvise`` or ``never``), or why there is none."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "not on this system"
    try:
        text = _THP.read_text()
    except OSError:
        return "not on this system"
    chosen = text[text.find("[") + 1:text.find("]")] if "[" in text else ""
    return chosen or "unknown"


def available() -> bool:
    return mode() in ("always", "madvise")


@contextlib.contextmanager
def huge_pages():
    """Within this block, on this thread, ``empty`` places tensors on memory advised for 2 MB pages."""
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = before


def _mapping(size: int) -> np.ndarray:
    """A fresh anonymous mapping of at least ``size`` bytes starting at a 2 MB boundary, advised for huge pages, as a
    uint8 array (which keeps the mapping alive while any view of it lives)."""
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # private: shared memory has no THP
    whole = np.frombuffer(m, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, size // HUGE * HUGE or HUGE)
    except OSError:  # a kernel or sandbox that refuses the advice: the memory works as well, on 4 kB pages
        pass
    return whole[start:start + size]


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)``, on memory advised for 2 MB pages inside ``huge_pages()`` where the
    system offers them (``available``)."""
    if not getattr(_local, "on", False) or not available():
        return torch.empty(shape, dtype=dtype)
    size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if size == 0:
        return torch.empty(shape, dtype=dtype)
    with _lock:
        if size > CHUNK // 4:  # a large one gets a mapping of its own
            block = _mapping(-(-size // ALIGN) * ALIGN)[:size]
        else:
            whole, start, used = (_chunk[0]() if _chunk[0] is not None else None), _chunk[1], _chunk[2]
            if whole is None or used + size > CHUNK:
                chunk, used = _mapping(CHUNK), 0
                whole, start = chunk.base, chunk.ctypes.data - chunk.base.ctypes.data
            block = whole[start + used:start + used + size]  # a view of the whole mapping's array, as chunk is
            _chunk[:] = weakref.ref(whole), start, -(-(used + size) // ALIGN) * ALIGN
    return torch.from_numpy(block).view(dtype).view(shape)


def huge_share(tensors) -> tuple[int, int]:
    """Of ``tensors``' bytes, how many lie on 2 MB pages now, by this process's ``/proc/self/smaps`` (its mappings'
    ``AnonHugePages``, shared out by address), and the total; (0, total) where that cannot be read."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    total = sum(e - s for s, e in spans)
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0, total
    huge_ranges, current = [], None
    for line in text.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = head.split("-")
            current = (int(lo, 16), int(hi, 16))
        elif head == "AnonHugePages:" and current is not None and int(line.split()[1]) > 0:
            huge_ranges.append((current, int(line.split()[1]) * 1024))
    on = 0
    for (lo, hi), huge in huge_ranges:
        inside = sum(max(0, min(e, hi) - max(s, lo)) for s, e in spans)
        on += min(inside, huge)
    return on, total

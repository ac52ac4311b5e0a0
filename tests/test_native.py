"""The lean forward's native calls (tr_core/speed/native.c): built on the machine that runs the suite, each call
equal to the torch operations it replaces to float tolerance, rows still computed alike alone and among others, and
torch's operations kept (and said) where the library cannot be built."""

import math
import shutil

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

from tr_core.speed import attention, kernels, lean, native
from tr_core.speed.chooser import prepare_model
from tr_core.speed.kernels import body, kernel_summary
from tr_core.speed.kv import keep_accepted_path, new_cache

HAS_COMPILER = bool(shutil.which("gcc") or shutil.which("cc"))
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on this machine: torch's operations run")


def library_here():
    """The library, which must build wherever a compiler is found."""
    lib = native.library()
    assert lib is not None, native.status()
    return lib


@pytest.fixture
def rebuilt(monkeypatch, tmp_path):
    """``native.library`` built afresh into an empty cache folder (and its process-wide copy restored after)."""
    from tr_core.speed import layouts

    def forget():  # the library, and what the layouts found of it
        native.library.cache_clear()
        layouts.available_layouts.cache_clear()
        layouts._native_linear.clear()

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    forget()
    yield tmp_path
    forget()


@needs_compiler
def test_the_library_is_built_once_per_machine_into_the_cache_folder(rebuilt):
    library_here()
    assert native.status() == "built for this CPU"
    built = list((rebuilt / "token-recycling" / "native").glob("native-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native.library.cache_clear()
    assert native.library() is not None
    assert built[0].stat().st_mtime_ns == stamp  # found, not rebuilt


def test_without_a_working_compiler_torch_operations_run_and_the_summary_says_why(rebuilt, monkeypatch):
    monkeypatch.setenv("CC", "/bin/false")
    assert native.library() is None
    assert native.status().startswith("not built: /bin/false failed")
    model = tiny_model("llama", dtype=torch.float32)
    prepare_model(model, "exact")
    said = "native calls not built: /bin/false failed" if kernels.attention_invariant(model) else "no batch-invariant"
    assert f"small operations: torch's operations ({said}" in kernel_summary(model)
    monkeypatch.setenv("TR_NATIVE", "0")
    native.library.cache_clear()
    assert native.library() is None and native.status() == "turned off (TR_NATIVE=0)"


@needs_compiler
def test_each_call_equals_the_torch_operations_it_replaces():
    lib = library_here()
    g = torch.Generator().manual_seed(1)
    n, d = 5, 48
    x, delta, w = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g), torch.randn(d, generator=g)
    expected_x = x + delta
    expected = lean._rms_norm(expected_x, w, 1e-6)
    out = torch.empty_like(x)
    lib.tr_add_rms_norm(x.data_ptr(), delta.data_ptr(), w.data_ptr(), 1e-6, n, d, out.data_ptr())
    torch.testing.assert_close(x, expected_x, rtol=0, atol=0)  # the residual stream, updated in place
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    gate, up = torch.randn(n, 3 * d, generator=g) * 30, torch.randn(n, 3 * d, generator=g)
    expected = torch.nn.functional.silu(gate) * up
    act, gate_up = torch.empty_like(gate), torch.cat([gate, up], 1)  # each row: its gate, then its up
    lib.tr_silu_mul(gate_up.data_ptr(), n, 3 * d, act.data_ptr())
    torch.testing.assert_close(act, expected, rtol=1e-5, atol=1e-6)
    heads, kv_heads, dim, past, padded = 4, 2, 16, 7, 12
    joined = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g)  # each row's q, k and v side by side
    q, k, v = joined.split((heads * dim, kv_heads * dim, kv_heads * dim), 1)
    cos, sin = torch.randn(n, dim, generator=g), torch.randn(n, dim, generator=g)
    queries = torch.zeros(kv_heads, padded, dim)
    keys, values = torch.zeros(1, kv_heads, 20, dim), torch.zeros(1, kv_heads, 20, dim)
    lib.tr_rope_store(q.data_ptr(), k.data_ptr(), v.data_ptr(), joined.stride(0), cos.data_ptr(), sin.data_ptr(), n,
                      heads, kv_heads, dim, 0.25, queries.data_ptr(), padded, keys.data_ptr(), values.data_ptr(),
                      keys.stride(1), past)
    signed = lean._signed(sin)[:, None]
    rope_q = lean._rope(q.reshape(n, heads, dim), cos[:, None], signed) * 0.25
    got_q = queries[:, :n * 2].view(kv_heads, n, 2, dim).transpose(0, 1).reshape(n, heads, dim)
    torch.testing.assert_close(got_q, rope_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(keys[0, :, past:past + n].transpose(0, 1),
                               lean._rope(k.reshape(n, kv_heads, dim), cos[:, None], signed), rtol=1e-6, atol=1e-6)
    assert torch.equal(values[0, :, past:past + n].transpose(0, 1).reshape(n, -1), v)
    assert not keys[0, :, :past].any() and not keys[0, :, past + n:].any()  # nothing written outside the rows


def _tree_rows(past: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and visibility of a random tree of ``n`` nodes on ``past`` cached positions (each node sees its
    ancestors and itself: holes in its window where its cousins are)."""
    parents = attention._random_tree(n, min(4, attention.window_room(past)), g) if n > 1 else [-1]
    paths = attention._paths(parents)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for i, path in enumerate(paths):
        visible[i, path] = True
    return past + torch.tensor([len(p) - 1 for p in paths]), visible


@needs_compiler
@pytest.mark.parametrize("kind", list(attention.KINDS))
@pytest.mark.parametrize("past, n, tree", [(0, 5, False), (100, 1, False), (300, 7, False), (130, 30, False),
                                          (70, 12, True), (260, 40, True)])
def test_native_attention_equals_the_torch_one_and_sdpa(past, n, tree, kind):
    lib = library_here()
    g = torch.Generator().manual_seed(past + n)
    heads, kv_heads, dim, capacity = 9, 3, 64, past + n + 17  # buffers longer than the keys they hold
    key_buf, value_buf = torch.randn(kv_heads, capacity, dim, generator=g), torch.randn(kv_heads, capacity, dim,
                                                                                       generator=g)
    keys, values = key_buf[:, :past + n], value_buf[:, :past + n]
    before = value_buf.clone()
    q = torch.randn(n, heads, dim, generator=g)
    positions, visible = _tree_rows(past, n, g) if tree else (torch.arange(past, past + n), None)
    product, pad = attention.KINDS[kind]
    try:
        product(torch.zeros(1, 2, 4), torch.zeros(1, 4, 3))
    except (RuntimeError, AttributeError, NotImplementedError) as exc:  # as batch_invariant passes it over
        pytest.skip(f"{kind} is not in this torch build: {exc}")
    outs = []
    for library in (None, lib):
        rows = attention.row_keys(past, positions, visible, heads // kv_heads)
        buffers = attention.scratch_for(rows, kv_heads, n, 3, dim, max(3 * n, pad), "cpu")
        torch.mul(q.view(n, kv_heads, 3, dim).transpose(0, 1), 0.125, out=buffers.step_queries)
        outs.append(attention.attend_scaled(buffers, keys, values, rows, n, product, library))
        # the pad rows the products run on stay zero
        assert not buffers.queries[:, 3 * n:].any() and not buffers.padded_shared[:, 3 * n:].any()
    assert torch.equal(value_buf, before)  # the cache is only read
    reference = attention.reference(q.transpose(0, 1)[None], keys[None], values[None], rows, 0.125)[0]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[1], reference, rtol=1e-5, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("call", ["tr_attend", "tr_attend_amx"])
@pytest.mark.parametrize("past", [5, 64, 200, 1100])
def test_native_attention_gives_a_row_the_same_bits_whatever_rows_share_its_call(past, call):
    """``tr_attend`` attends up to 8 query rows of a kv head together (each key read once for them) and splits the
    rows among threads by the call's size: a row's output must not depend on either. The first k nodes of a tree
    (breadth-first: ancestors first) are a tree of their own, so each is computed in calls of 1 to 40 rows and on 1
    or 2 threads, and must come out bit-equal. So must ``tr_attend_amx`` (the keys before the window on AMX tiles, 16
    rows a tile; the amx format's), which is within bf16's rounding of SDPA."""
    lib = library_here()
    attend = lib.tr_attend if call == "tr_attend" else native.attention_on_tiles()
    if attend is None:
        pytest.skip("attention on AMX tiles needs a CPU with amx_tile and amx_bf16, and the kernel's grant")
    g = torch.Generator().manual_seed(past)
    heads, kv_heads, dim, n = 9, 3, 64, 40
    keys, values = torch.randn(kv_heads, past + n, dim, generator=g), torch.randn(kv_heads, past + n, dim, generator=g)
    q = torch.randn(n, heads, dim, generator=g)
    positions, visible = _tree_rows(past, n, g)
    outs = {}
    for count in (1, 2, 5, 13, 17, 40):
        rows = attention.row_keys(past, positions[:count], visible[:count, :count], heads // kv_heads)
        for threads in (1, 2):
            buffers = attention.scratch_for(rows, kv_heads, count, 3, dim, 3 * count, "cpu")
            torch.mul(q[:count].view(count, kv_heads, 3, dim).transpose(0, 1), 0.125, out=buffers.step_queries)
            out = torch.empty(count, heads * dim)
            attend(buffers.queries.data_ptr(), 3 * count, keys.data_ptr(), values.data_ptr(), keys.stride(0),
                   rows.start, rows.index.data_ptr(), rows.valid.data_ptr(), count, 3, kv_heads, dim, out.data_ptr(),
                   threads)
            outs[count, threads] = out
    whole = outs[40, 2]
    for (count, threads), out in outs.items():
        assert torch.equal(out, whole[:count]), (count, threads)
    reference = attention.reference(q.transpose(0, 1)[None] * 1.0, keys[None], values[None], attention.row_keys(
        past, positions, visible, 3), 0.125)[0]
    tolerance = (1e-5, 1e-6) if call == "tr_attend" else (3e-2, 2e-2)
    torch.testing.assert_close(whole, reference, rtol=tolerance[0], atol=tolerance[1])


@pytest.mark.parametrize("use_native", [True, False])
def test_rows_agree_on_either_path(monkeypatch, use_native):
    # the check batch_invariant runs for the path this process takes, run here for both
    if not use_native:
        monkeypatch.setattr(attention.native, "library", lambda: None)
    elif native.library() is None:
        pytest.skip(f"native calls {native.status()}")
    assert any(attention._rows_agree(kind, 9, 3, 64) for kind in attention.KINDS)


@needs_compiler
@torch.inference_mode()
def test_the_lean_forward_on_native_calls_equals_it_on_torch_operations(monkeypatch):
    lib = library_here()
    model = tiny_model("llama", dtype=torch.float32)
    prepare_model(model, "exact")
    forward = body(model)
    assert "small operations: native calls built for this CPU" in kernel_summary(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 70), generator=g)
    ran = []
    real = lean.LeanLlama._windowed_native
    monkeypatch.setattr(lean.LeanLlama, "_windowed_native", lambda self, *a: ran.append(1) or real(self, *a))

    def run(cache):
        out = [forward(input_ids=ids[:, :64], cache=cache).last_hidden_state]
        out.append(forward(input_ids=ids[:, 64:66], position_ids=torch.tensor([[64, 65]]),
                           cache=cache).last_hidden_state)
        out.append(forward(input_ids=ids[:, 66:67], position_ids=torch.tensor([[66]]), cache=cache).last_hidden_state)
        return out + [torch.cat([layer.keys for layer in cache.layers])]

    with_native = run(new_cache(model.config, 8))  # small: reallocated while the steps run
    assert len(ran) == 3 and native.library() is lib
    on_dynamic = run(DynamicCache(config=model.config))  # a cache without preallocated buffers: the same bits
    assert len(ran) == 6
    monkeypatch.setattr(native, "library", lambda: None)  # torch's operations everywhere, attention too
    on_torch = run(new_cache(model.config, 8))
    assert len(ran) == 6
    for a, b, c in zip(with_native, on_dynamic, on_torch):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def _cpu_has_avx512_for_linear() -> bool:
    try:
        flags = set(native._cpu_flags().split())
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512vl"} <= flags


@needs_compiler
@pytest.mark.skipif(not _cpu_has_avx512_for_linear(), reason="the C linear layers need AVX-512 F/BW/VL")
@pytest.mark.parametrize("name, kind", [("fp16n", torch.float16), ("native", torch.float32),
                                        ("bf16n", torch.bfloat16), ("amxn", "amx")])
# (16400, 40): an output of 81 rows (5.3 MB) larger than a core's L2 cache, which the AMX kernel writes in streamed
# stores (and a tail block of 16 outputs, written as the others are)
@pytest.mark.parametrize("out_features, in_features", [(80, 48), (7, 37), (3, 1000), (129, 16), (16400, 40)])
def test_the_c_linear_computes_its_product_and_each_row_alone_whatever_the_rows(name, kind, out_features,
                                                                                 in_features):
    """native.c's linear layers (the "fp16n", "native", "bf16n" and "amxn" layouts) against the product of the
    (rounded) weights (and, for bf16 products, rounded inputs), with tails in rows, inputs and outputs; every row's
    bits equal at every row count and thread count, also with cancelling sums (where a different order of additions
    shows)."""
    from tr_core.speed.layouts import LAYOUTS, available_layouts
    library_here()
    if kind == torch.bfloat16 and native.linear(kind) is None:
        pytest.skip("bf16 products need AVX-512 BF16")
    if kind == "amx" and native.linear(kind) is None:
        pytest.skip("AMX tiles need a CPU with amx_tile and amx_bf16, and the kernel's grant of the tile state")
    assert native.linear(kind) is not None and name in available_layouts()
    dtype = torch.bfloat16 if kind == "amx" else kind
    layout = LAYOUTS[name]
    g = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=g)
    packed = layout.pack(weight)
    assert packed.tiles.dtype == dtype and (packed.out_features, packed.in_features) == weight.shape
    assert packed.kernel == kind
    x = torch.randn(81, in_features, generator=g)
    x[:, ::2] *= 1e4  # large terms that cancel in part: the rounding depends on the order of the sum
    full = layout.run(x, packed)
    assert full.shape == (81, out_features)
    inputs = x.to(torch.bfloat16) if dtype == torch.bfloat16 else x  # bf16 products round their inputs
    product = inputs.double() @ weight.to(dtype).double().t()
    torch.testing.assert_close(full.double(), product, rtol=1e-5, atol=1e-5 * x.abs().max().item())
    threads = torch.get_num_threads()
    set_fetch = native._OPTIONAL_HERE["tr_fetch_from_rows"]
    set_share = native._OPTIONAL_HERE.get("tr_small_ops_shared", lambda floats: None)
    try:
        # the kernels prefetching their weights from 2 rows or never, the AMX layer's inputs rounded by the threads
        # together at every size or by one (native.choose_sharing): the same bits
        for fetch, share in ((2, 0), (native.NEVER, native.SHARE_NEVER)):
            set_fetch(fetch)
            set_share(share)
            for count in (1, threads):
                torch.set_num_threads(count)
                for rows in (*range(1, 26), 33, 47, 81):  # each kernel (1-12 rows) alone and after 12; AMX tiles
                    for start in (0, 81 - rows):
                        assert torch.equal(layout.run(x[start:start + rows].contiguous(), packed),
                                           full[start:start + rows]), (rows, start, count, fetch)
    finally:
        torch.set_num_threads(threads)
        set_fetch(native._FETCH["rows"])
        set_share(native._SHARING["floats"])
    with pytest.raises(ValueError):
        layout.run(x.double(), packed)
    with pytest.raises(ValueError):
        layout.run(x[:, :-1].contiguous(), packed)
    with pytest.raises(ValueError):  # tiles that do not hold the weight's shape
        layout.run(x, type(packed)(packed.tiles[:-1], out_features, in_features))


@needs_compiler
def test_the_c_linear_is_absent_without_the_library(rebuilt, monkeypatch):
    """TR_NATIVE=0: no native linear, and the kernel cache is keyed apart (a plan measured with it is not taken)."""
    from tr_core.speed import layouts
    model = tiny_model("llama", dtype=torch.float32)
    with_native = layouts.cache_key(model, "fast")
    monkeypatch.setenv("TR_NATIVE", "0")
    native.library.cache_clear()
    assert native.linear(torch.float16) is None and native.linear(torch.float32) is None
    assert layouts.cache_key(model, "fast") != with_native and "-torch-" in layouts.cache_key(model, "fast")
    assert not {"fp16n", "native"} & set(layouts.available_layouts())


@needs_compiler
@pytest.mark.skipif(not _cpu_has_avx512_for_linear(), reason="the C linear layers need AVX-512 F/BW/VL")
@pytest.mark.parametrize("mode, name", [("exact", "native"), ("fast", "fp16n"), ("fast", "bf16n"),
                                        ("fast", "amxn")])
@torch.inference_mode()
def test_a_pass_in_one_c_call_equals_the_same_calls_made_from_python(monkeypatch, mode, name):
    """``tr_layers`` (the body's layers in one C call, where every linear layer runs native.c's kernel) against the
    lean forward making the same calls one by one: the same bits for a prefill chunk, a chain and a tree, and the same
    cache; and the chooser puts the body on that layout where its bare calls score as well."""
    from tr_core.speed import layouts
    library_here()
    assert native.stacked() is not None
    if name not in layouts.available_layouts():
        pytest.skip(f"{name} does not run on this CPU")
    model = tiny_model("llama", dtype=torch.float32)
    assert lean.fuse(model) and lean.stackable(model)
    counts = {s: len(ls) for s, ls in layouts.linear_shapes(model).items()}
    # a layout of the same format faster call by call, slower than the bare calls (bf16 products have none)
    others = {"native": ("linear",), "fp16n": ("fp16w",), "bf16n": (), "amxn": ()}[name]
    timings = {(s, r, n): ms for s in counts for r in (1, 2, 4) for n, ms in ((name, 1.0),) + tuple(
        (other, 0.8) for other in others)}
    plan = layouts.make_plan(mode, timings, counts, (name, *others), invariant={s: [name, *others] for s in counts},
                             inside={(s, r, name): 0.5 for s in counts for r in (1, 2, 4)})
    assert plan.stacked and plan.fmt == layouts.LAYOUTS[name].fmt
    assert {plan.layouts[s][r] for s in counts if s != layouts.HEAD for r in plan.rows} == {name}
    prepare_model(model, mode, plan)
    forward = body(model)
    calls = []
    real = lean.LeanLlama._stacked
    monkeypatch.setattr(lean.LeanLlama, "_stacked", lambda self, *a: calls.append(a[2].shape[0]) or real(self, *a))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 69), generator=g)
    tree = torch.full((1, 1, 3, 69), float("-inf"))  # a root at 66 and its two children at 67, on 66 positions
    tree[..., :66] = 0
    for node, seen in enumerate(([0], [0, 1], [0, 2])):
        tree[0, 0, node, [66 + s for s in seen]] = 0

    def run():
        cache = new_cache(model.config, 8)  # small: reallocated while the steps run
        out = [forward(input_ids=ids[:, :64], cache=cache).last_hidden_state,
               forward(input_ids=ids[:, 64:66], position_ids=torch.tensor([[64, 65]]), cache=cache).last_hidden_state,
               forward(input_ids=ids[:, 66:69], position_ids=torch.tensor([[66, 67, 67]]), attention_mask=tree,
                       cache=cache).last_hidden_state]
        return out + [torch.cat([torch.cat([layer.keys, layer.values]) for layer in cache.layers])]

    in_c = run()
    assert calls == [64, 2, 3]
    monkeypatch.setattr(lean.LeanLlama, "stacked", False)
    from_python = run()
    assert calls == [64, 2, 3]
    for a, b in zip(in_c, from_python):
        assert torch.equal(a, b)
    # a norm's weight given new memory (as chooser.own_weights does): the one call reads the new one
    norm = model.base_model.layers[1].post_attention_layernorm.weight
    norm.data = norm.data * 1.5
    monkeypatch.setattr(lean.LeanLlama, "stacked", True)
    moved = run()
    assert len(calls) == 6 and not torch.equal(moved[0], in_c[0])
    monkeypatch.setattr(lean.LeanLlama, "stacked", False)
    reference = run()
    for a, b in zip(moved, reference):
        assert torch.equal(a, b)
    # the small operations shared among the threads at every size and at none (the choice native.choose_sharing
    # makes per machine): the same bits in one call
    set_share = native._OPTIONAL_HERE.get("tr_small_ops_shared")
    if set_share is not None:
        monkeypatch.setattr(lean.LeanLlama, "stacked", True)
        try:
            for floats in (0, native.SHARE_NEVER):
                set_share(floats)
                for a, b in zip(run(), reference):
                    assert torch.equal(a, b), floats
        finally:
            set_share(native._SHARING["floats"])
    # where the bare calls score worse, the layouts stay those chosen call by call, and no pass runs in one call
    for other in others:
        slower = layouts.make_plan(mode, timings, counts, (name, other), invariant={s: [name, other] for s in counts},
                                   inside={(s, r, name): 0.9 for s in counts for r in (1, 2, 4)})
        assert not slower.stacked and slower.layouts[next(iter(counts))][1] == other


@needs_compiler
@torch.inference_mode()
def test_the_amx_format_attends_on_tiles_kept_with_the_cache_as_on_tiles_laid_afresh(monkeypatch):
    """In the amx format attention runs on AMX tiles, in ``tr_layers`` on tiles kept with the cache (laid once per
    64 positions: ``kv.tiles_for``) and call by call on tiles laid afresh: the same bits through prefill chunks,
    plain steps across windows, a tree, and a crop below the tiles laid followed by other tokens (the tiles of the
    cut positions laid again), and other bits than fp32 attention's (so the tiles did run)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tr_core.speed import layouts
    library_here()
    if "amxn" not in layouts.available_layouts() or native.attention_on_tiles() is None:
        pytest.skip("attention on AMX tiles needs a CPU with amx_tile and amx_bf16, and the kernel's grant")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=512)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert lean.fuse(model) and lean.stackable(model)
    counts = {s: len(ls) for s, ls in layouts.linear_shapes(model).items()}
    timings = {(s, r, "amxn"): 1.0 for s in counts for r in (1, 2, 4)}
    plan = layouts.make_plan("fast", timings, counts, ("amxn",), invariant={s: ["amxn"] for s in counts},
                             inside={(s, r, "amxn"): 0.5 for s in counts for r in (1, 2, 4)})
    prepare_model(model, "fast", plan)
    forward = body(model)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (1, 300), generator=g)
    other = torch.randint(0, 64, (1, 300), generator=g)

    def run(stacked: bool):
        monkeypatch.setattr(lean.LeanLlama, "stacked", stacked)
        cache = new_cache(model.config, 320, torch.float32)  # one store: tr_layers keeps the tiles with it
        out = [forward(input_ids=ids[:, a:a + 64], cache=cache).last_hidden_state for a in (0, 64)]
        out += [forward(input_ids=ids[:, p:p + 1], cache=cache).last_hidden_state for p in range(128, 200)]
        tree = torch.full((1, 1, 3, 203), float("-inf"))  # a root at 200 and its two children at 201
        tree[..., :200] = 0
        for node, seen in enumerate(([0], [0, 1], [0, 2])):
            tree[0, 0, node, [200 + s for s in seen]] = 0
        out.append(forward(input_ids=ids[:, 200:203], position_ids=torch.tensor([[200, 201, 201]]),
                           attention_mask=tree, cache=cache).last_hidden_state)
        keep_accepted_path(cache, 200, 3, torch.tensor([0, 2]))  # the second child moved over the first
        out += [forward(input_ids=ids[:, p:p + 1], cache=cache).last_hidden_state for p in range(202, 210)]
        # below the tiles laid up to 192: those of 128..191 must be laid again from other keys
        cache.crop(150 - cache.get_seq_length())
        out += [forward(input_ids=other[:, p:p + 1], cache=cache).last_hidden_state for p in range(150, 270)]
        return out, getattr(cache, "kv_tiles", None)

    kept, tiles = run(True)
    assert tiles is not None and tiles[3] == 256  # kept with the cache, laid up to the last window's start
    afresh, none = run(False)
    assert none is None
    assert all(torch.equal(a, b) for a, b in zip(kept, afresh))
    native.set_attention_on_tiles(False)
    try:
        fp32, _ = run(True)
    finally:
        native.set_attention_on_tiles(True)
    assert not torch.equal(kept[-1], fp32[-1])
    torch.testing.assert_close(kept[-1], fp32[-1], rtol=0.1, atol=0.1)


def test_the_small_operations_are_shared_from_the_fewest_rows_where_sharing_measurably_pays_beyond():
    """``choose_sharing`` on stubbed timings: from the fewest rows of SHARE_ROWS from which sharing pays at every
    larger count (a gain at 6 rows alone, inside a loss at 11, is noise), never where it stays inside SHARE_GAIN; the
    pairs alternate which runs first; the choice is keyed into the timing caches and said in the kernels' line."""
    calls = []

    def stub(ratio_at: dict):
        def timed(shared, rows):
            calls.append(shared)
            return 10.0 * (ratio_at.get(rows, 1.0) if shared else 1.0)
        return timed

    width = native.SHARE_WIDTH
    assert native.choose_sharing(stub({3: 0.5, 6: 0.5, 11: 0.5, 22: 0.5, 43: 0.5}))[0] == 3 * width - 1
    assert native.choose_sharing(stub({6: 0.8, 11: 1.1, 22: 0.9, 43: 0.8})) == (
        22 * width - 1, "3 rows 1.00x, 6 rows 0.80x, 11 rows 1.10x, 22 rows 0.90x, 43 rows 0.80x")
    assert native.choose_sharing(stub({rows: 0.98 for rows in native.SHARE_ROWS}))[0] == native.SHARE_NEVER
    assert native.choose_sharing(stub({3: 0.5, 43: 1.2}))[0] == native.SHARE_NEVER  # not at the most rows: never
    assert calls[:4] == [True, False, False, True]
    if native.library() is not None and "tr_silu_mul_rows" in native._OPTIONAL_HERE:
        assert native.tag().endswith(f"s{native._SHARING['floats']}")
        assert "measured here" in native.sharing_note() or "one thread" in native.sharing_note()


def test_the_prefetch_is_kept_from_the_first_row_count_where_it_measurably_pays():
    """``choose_fetch`` on stubbed timings: from 1 row where every call gains, from 2 where a 3-row call gains and a
    1-row one does not, from 5 where a 6-row call gains, from 9 where only a 12-row call does, and from a later
    setting where an earlier one's gain is followed by a loss (an AMD EPYC's 2-4 rows); never where the gain stays
    inside FETCH_GAIN; the pairs alternate which setting runs first."""
    calls = []

    def stub(gain_at: dict):
        def timed(setting, rows):
            calls.append(setting)
            return 10.0 * (gain_at.get(rows, 1.0) if setting != native.NEVER else 1.0)
        return timed

    assert native.choose_fetch(stub({1: 0.9, 3: 0.8, 6: 0.8, 12: 0.7}))[0] == 1
    assert native.choose_fetch(stub({3: 0.8, 6: 0.8, 12: 0.7}))[0] == 2
    assert native.choose_fetch(stub({6: 0.8, 12: 0.7}))[0] == 5
    assert native.choose_fetch(stub({6: 1.05, 12: 0.9})) == (
        9, "1 row 1.00x, 3 rows 1.00x, 6 rows 1.05x, 12 rows 0.90x")
    assert native.choose_fetch(stub({1: 0.9, 3: 1.05, 6: 0.8, 12: 0.8}))[0] == 5
    assert native.choose_fetch(stub({6: 0.98, 12: 0.98}))[0] == native.NEVER  # inside the noise: not taken
    assert calls[:4] == [1, native.NEVER, native.NEVER, 1]
    if native.library() is not None and "tr_fetch_from_rows" in native._OPTIONAL_HERE:
        # chosen on this machine when the library loaded, said in the kernels' line and keyed into the timing caches
        assert f"p{native._FETCH['rows']}" in native.tag() and "measured here" in native.fetch_note()


@needs_compiler
def test_the_amx_format_attends_on_the_tiles_only_where_its_steps_measure_faster(monkeypatch, tmp_path):
    """``chooser.tiles_choice`` on stubbed whole steps: the tiles kept where their steps take at most fp32
    attention's time (geometric mean over the sizes), fp32 attention where they measure slower; the choice is kept
    per machine (not measured again), put into the model by ``prepare_model`` (the process's attention follows it),
    said in the mode's description, and part of the plan's tag (what t(N) is cached under)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tr_core.speed import chooser, kernels, layouts, stepbench
    library_here()
    if "amxn" not in layouts.available_layouts() or not native.attention_tiles_built():
        pytest.skip("attention on AMX tiles needs a CPU with amx_tile and amx_bf16, and the kernel's grant")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the choices kept here, not in the machine's cache
    config = LlamaConfig(vocab_size=64, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, head_dim=64, max_position_embeddings=512)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert lean.fuse(model)
    counts = {s: len(ls) for s, ls in layouts.linear_shapes(model).items()}
    plan = layouts.make_plan("fast", {(s, r, "amxn"): 1.0 for s in counts for r in (1, 2, 4)}, counts, ("amxn",),
                             invariant={s: ["amxn"] for s in counts})
    calls = []

    def pairs(ratio):
        def timed(trial, prefix, rounds):
            calls.append(native.attention_on_tiles() is not None)  # timed from the tiles on, whatever was set
            return {n: (10.0 * ratio, 10.0, ratio) for n in stepbench.ATTENTION_SIZES}
        return timed

    was = native.attention_on_tiles() is not None
    try:
        native.set_attention_on_tiles(False)
        monkeypatch.setattr(stepbench, "attention_pairs", pairs(1.1))
        on, note = chooser.tiles_choice(model, plan)
        assert (on, calls) == (False, [True]) and native.attention_on_tiles() is None  # the setting as it was
        assert note.startswith("attention in fp32, chosen by measurement: whole steps 1.10x")
        monkeypatch.setattr(stepbench, "attention_pairs", pairs(0.9))
        assert chooser.tiles_choice(model, plan) == (False, note) and len(calls) == 1  # kept: not measured again
        assert chooser.tiles_choice(model, plan, remeasure=True)[0] is True and len(calls) == 2
        untried = plan.tag()
        plan.tiles, plan.tiles_note = False, note
        assert plan.tag() != untried
        native.set_attention_on_tiles(True)
        chooser.prepare_model(model, "fast", plan)  # the plan's choice put into the process's attention
        assert native.attention_on_tiles() is None and note in kernels.describe_format(plan)
    finally:
        native.set_attention_on_tiles(was)


def test_the_prefetch_is_timed_on_twice_the_last_level_cache_within_bounds(tmp_path, monkeypatch):
    """The largest cache sysfs lists (sizes with K, M or G), and the layer sets the prefetch is timed on: twice it,
    at least FETCH_BYTES[0], at most FETCH_BYTES[1]; where sysfs says nothing, twice FETCH_BYTES[0]."""
    for index, size in enumerate(("48K", "2048K", "307200K", "junk")):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert native._last_level_cache_bytes(tmp_path) == 300 << 20
    assert native._last_level_cache_bytes(tmp_path / "none") is None
    per_set = sum(out * inputs * 4 for out, inputs in native.FETCH_SHAPES)
    low, high = native.FETCH_BYTES
    for cache, expected in ((None, 2 * low), (32 << 20, low), (300 << 20, 600 << 20), (400 << 20, high)):
        monkeypatch.setattr(native, "_last_level_cache_bytes", lambda cache=cache: cache)
        assert native._fetch_sets() == -(-expected // per_set), cache


@needs_compiler
@pytest.mark.skipif(not _cpu_has_avx512_for_linear(), reason="tr_top_k is built where the CPU has AVX-512 F/BW/VL")
def test_the_c_top_k_finds_each_rows_k_best_and_topk_asks_it_for_a_large_vocabulary():
    """native.c's ``tr_top_k`` against ``torch.topk`` over the embedded model's vocabulary (49,152) and a ragged one:
    the same values best first, ids that hold them, the lowest first among equal values (rows full of ties); it
    declines what it cannot answer (a NaN, fewer than k values above -infinity, a strided view, k past 64), and
    ``topk.top_k`` takes its answer for a large vocabulary once the library has loaded."""
    from tr_core import topk
    library_here()
    assert "tr_top_k" in native._OPTIONAL_HERE and topk._FASTER == [native.top_k]
    g = torch.Generator().manual_seed(0)
    for vocab in (49152, 5003):
        x = torch.randn(21, vocab, generator=g)
        x[3] = torch.randint(0, 4, (vocab,), generator=g).float()  # thousands of equal values
        x[5, ::7] = 50.0  # ties at the top
        x[7, 100:] = -math.inf
        for k in (1, 8, 16):
            for rows in (1, 2, 21):
                values, ids = native.top_k(x[:rows], k)
                assert torch.equal(values, torch.topk(x[:rows], k).values)
                assert torch.equal(x[:rows].gather(1, ids), values)
                for r in range(rows):  # among equal values the lowest ids, in order
                    for w in values[r].unique().tolist():
                        held = ids[r][values[r] == w].tolist()
                        assert held == sorted(held) == (x[r] == w).nonzero()[:len(held), 0].tolist(), (r, w)
        assert torch.equal(topk.top_k(x, 8).indices, native.top_k(x, 8)[1])
    x = torch.randn(4, 5000, generator=g)
    assert native.top_k(x[:, ::2], 8) is None and native.top_k(x, 65) is None and native.top_k(x.double(), 8) is None
    x[2, 10] = math.nan
    assert native.top_k(x, 8) is None
    x[2, 10], x[1, 3:] = 0.0, -math.inf  # 3 values above -infinity: k = 3 is answered, k = 4 is not
    assert native.top_k(x, 3) is not None and native.top_k(x, 4) is None

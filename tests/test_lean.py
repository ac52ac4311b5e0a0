"""The lean Llama forward must compute what transformers' LlamaModel computes: bit for bit where it keeps torch's
attention (float64), to float tolerance where it runs the batch-invariant attention (fp32;
tr_core/speed/attention.py)."""

import pytest
import torch
from conftest import tiny_model
from transformers import DynamicCache

from tr_core.speed.backend import tree_mask
from tr_core.speed.kernels import body
from tr_core.speed.kv import new_cache
from tr_core.speed.lean import LeanLlama, supports
from tr_core.tree import build_tree, load_template


def _steps(forward, model, cache):
    """A prefill, one token, a chain of three on top of the cache, and a 6-node tree under its mask."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    out = [forward(input_ids=torch.randint(0, vocab, (1, 40), generator=g), cache=cache).last_hidden_state]
    out.append(forward(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[40]]), cache=cache).last_hidden_state)
    out.append(forward(input_ids=torch.tensor([[7, 8, 9]]), cache=cache).last_hidden_state)
    tree = build_tree(list(load_template("paper").node_paths[1:6]))
    mask = tree_mask(tree, 44, model.dtype, model.device)
    ids = torch.randint(0, vocab, (1, 6), generator=g)
    out.append(forward(input_ids=ids, position_ids=(44 + tree.depth)[None], attention_mask=mask,
                       cache=cache).last_hidden_state)
    out.append(torch.cat([layer.keys for layer in cache.layers]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cache_kind", ["dynamic", "preallocated"])
@torch.inference_mode()
def test_lean_forward_equals_the_models_own(dtype, cache_kind):
    model = tiny_model("llama", dtype=dtype)
    assert supports(model)
    make = (lambda: DynamicCache(config=model.config)) if cache_kind == "dynamic" else (
        lambda: new_cache(model.config, 16))  # small: the buffer is reallocated while the steps run
    expected = _steps(model.base_model, model, make())
    got = _steps(LeanLlama(model), model, make())
    for e, g in zip(expected, got):
        assert e.shape == g.shape
        if dtype == torch.float64:
            assert torch.equal(e, g)
        else:
            torch.testing.assert_close(e, g, rtol=1e-5, atol=1e-5)


def test_decoding_runs_the_lean_forward_only_where_it_applies():
    llama, qwen, gpt2 = tiny_model("llama"), tiny_model("qwen2"), tiny_model("gpt2")
    assert isinstance(body(llama), LeanLlama)
    assert body(llama) is body(llama)  # made once per model
    assert not supports(qwen) and body(qwen) is qwen.base_model
    assert not supports(gpt2) and body(gpt2) is gpt2.base_model


def test_lean_forward_follows_linears_swapped_after_it_was_made():
    from tr_core.speed.chooser import prepare_model
    from tr_core.speed.kernels import ChosenLinear
    from tr_core.speed.layouts import linear_shapes, make_plan
    model = tiny_model("llama", dtype=torch.float32)
    lean = body(model)
    counts = {s: len(ls) for s, ls in linear_shapes(model).items()}
    timings = {(s, r, n): 1.0 if n == "wxt" else 2.0 for s in counts for r in (1, 4) for n in ("linear", "wxt")}
    prepare_model(model, "exact", plan=make_plan("exact", timings, counts, ("linear", "wxt")))
    assert isinstance(model.base_model.layers[0].self_attn.q_proj, ChosenLinear)
    with torch.inference_mode():
        ids = torch.tensor([[1, 2, 3, 4]])
        want = model.base_model(input_ids=ids, cache=DynamicCache(config=model.config)).last_hidden_state
        got = lean(input_ids=ids, cache=DynamicCache(config=model.config)).last_hidden_state
    torch.testing.assert_close(want, got, rtol=1e-5, atol=1e-5)  # fp32: the batch-invariant attention


@torch.inference_mode()
def test_fused_projections_compute_what_the_separate_ones_did():
    from tr_core.speed.lean import fuse, fused_shapes
    model = tiny_model("llama", dtype=torch.float32)
    assert fused_shapes(model) == {"128x64", "256x64"}  # q 64 + k 32 + v 32; gate 128 + up 128 (conftest's config)
    assert fused_shapes(tiny_model("qwen2")) == set() and not fuse(tiny_model("qwen2"))
    biased = tiny_model("llama", dtype=torch.float32)
    biased.base_model.layers[0].mlp.up_proj.bias = torch.nn.Parameter(torch.zeros(128))
    assert fused_shapes(biased) == set() and not fuse(biased)  # a bias it would drop: left as it is
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    before_model = model.base_model(input_ids=ids).last_hidden_state
    before_lean = _steps(LeanLlama(model), model, new_cache(model.config, 16))
    k_weight = model.base_model.layers[1].self_attn.k_proj.weight.clone()
    assert fuse(model) and fuse(model)  # idempotent
    attn = model.base_model.layers[1].self_attn
    assert torch.equal(attn.qkv_proj.weight[64:96], k_weight) and attn.k_proj.out_features == 32
    assert not any(isinstance(m, torch.nn.Linear) for name, m in model.base_model.named_modules()
                   if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    # transformers' own forward runs on the parts, the lean forward on the fused layers
    torch.testing.assert_close(model.base_model(input_ids=ids).last_hidden_state, before_model, rtol=1e-5, atol=1e-5)
    for a, b in zip(_steps(LeanLlama(model), model, new_cache(model.config, 16)), before_lean):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # a deep copy's parts read the copy's fused layers, not the original's
    import copy
    twin = copy.deepcopy(model)
    twin.base_model.layers[0].self_attn.qkv_proj.weight.mul_(2)
    assert not torch.equal(twin.base_model(input_ids=ids).last_hidden_state, model.base_model(input_ids=ids)
                           .last_hidden_state)
    torch.testing.assert_close(model.base_model(input_ids=ids).last_hidden_state, before_model, rtol=1e-5, atol=1e-5)


def test_prepare_model_fuses_where_it_measures_the_fused_shapes():
    from tr_core.speed.chooser import prepare_model
    from tr_core.speed.kernels import ChosenLinear
    from tr_core.speed.layouts import linear_shapes, make_plan
    model = tiny_model("llama", dtype=torch.float32)
    counts = {s: len(ls) for s, ls in linear_shapes(model).items()}  # the separate layers' shapes
    timings = {(s, r, n): 1.0 for s in counts for r in (1, 4) for n in ("linear",)}
    prepare_model(model, "exact", plan=make_plan("exact", timings, counts, ("linear",)))
    assert isinstance(model.base_model.layers[0].self_attn.q_proj, ChosenLinear)  # a plan for them: not fused
    fused = tiny_model("llama", dtype=torch.float32)
    prepare_model(fused, "exact")  # measured here: on the fused layers
    attn = fused.base_model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, ChosenLinear) and "256x64" in kernels_table_shapes(fused)  # gate and up as one


def kernels_table_shapes(model) -> set[str]:
    from tr_core.speed.kernels import kernel_table
    return {row["shape"] for row in kernel_table(model)}


def test_a_plain_steps_rotary_row_is_the_modules_own_for_that_position_alone():
    # the one-row pass reads its (cos, sin) from the module's output for the 64 positions around it (made once per
    # block): bit for bit what the module gives for the position alone, in fp32 and bf16, across blocks
    model = tiny_model("llama")
    lean = LeanLlama(model)
    for dtype in (torch.float32, torch.bfloat16):
        hidden = torch.zeros(1, 1, model.config.hidden_size, dtype=dtype)
        with torch.inference_mode():
            for position in (0, 1, 63, 64, 65, 130, 191, 1000, 4095, 40_000):
                ids = torch.tensor([[position]])
                cos, sin = lean._rotary(hidden, ids)
                alone = lean.rotary(hidden, ids)
                assert cos.shape == alone[0].shape and cos.is_contiguous() and cos.dtype == dtype
                assert torch.equal(cos, alone[0]) and torch.equal(sin, alone[1]), position
                assert lean._rotary(hidden, ids)[0] is cos  # kept
    # with gradients on, or for several rows, the module itself
    ids = torch.tensor([[5, 6]])
    assert torch.equal(lean._rotary(hidden, ids)[0], lean.rotary(hidden, ids)[0])
    with torch.enable_grad():
        assert lean._rotary(hidden, torch.tensor([[7]]))[0] is not lean._rotary(hidden, torch.tensor([[7]]))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # windowed attention (fp32), torch's SDPA (float64)
@torch.inference_mode()
def test_a_tree_step_given_only_which_rows_each_row_sees_equals_it_under_the_whole_mask(dtype):
    """Decoding gives the lean forward a tree's own (n, n) visibility (``decoding.tree_attention``) instead of a 4D mask
    over the whole cache, which grew with the context: the same bits either way, on either attention path."""
    from tr_core.speed.backend import tree_attention

    model = tiny_model("llama", dtype=dtype)
    lean = LeanLlama(model)
    tree = build_tree(list(load_template("paper").node_paths[1:9]))
    ids = torch.randint(0, model.config.vocab_size, (1, 42 + tree.size), generator=torch.Generator().manual_seed(1))
    outs = []
    for how in ("mask", "visible"):
        cache = new_cache(model.config, 80)
        lean(input_ids=ids[:, :42], cache=cache)
        seen = ({"attention_mask": tree_mask(tree, 42, model.dtype, model.device)} if how == "mask"
                else {"visible": tree.mask})
        outs.append(lean(input_ids=ids[:, 42:], position_ids=(42 + tree.depth)[None], cache=cache,
                         **seen).last_hidden_state)
    assert torch.equal(outs[0], outs[1])
    windowed = lean.window is not None
    seen = tree_attention(lean, tree, 42, model.dtype, model.device)
    assert list(seen) == (["visible"] if windowed else ["attention_mask"])
    assert tree_attention(lean, build_tree([[0], [0, 0]]), 42, model.dtype, model.device) == {}  # a chain: causal
    assert list(tree_attention(model.base_model, tree, 42, model.dtype, model.device)) == ["attention_mask"]

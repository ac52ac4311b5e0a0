import pytest
import torch

from conftest import tiny_model
from tr_core import kernels
from tr_core.kernels import OutputHead, fp16_weights_available, mode_dtype

# where this torch build has no fbgemm (not x86 or without AVX2), the fast mode falls back to bf16 and has no
# fp16-weight linear to test
needs_fbgemm = pytest.mark.skipif(not fp16_weights_available(),
                                  reason="this torch build has no fbgemm fp16-weight linear")


def test_output_head_equals_the_models_own_output_layer():
    for arch in ("llama", "gpt2"):
        model = tiny_model(arch, dtype=torch.float32)
        head = OutputHead(model)
        for n in (1, 2, 7):
            hidden = torch.randn(n, model.config.hidden_size if arch == "llama" else model.config.n_embd)
            torch.testing.assert_close(head(hidden), model.get_output_embeddings()(hidden), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fbgemm, native_bf16, fast", [
    (True, False, (torch.float32, "fast: fp16 weights, fp32 arithmetic")),
    (True, True, (torch.float32, "fast: fp16 weights, fp32 arithmetic")),
    (False, True, (torch.bfloat16, "fast: bf16 (native)")),
    (False, False, (torch.bfloat16, "fast: bf16 (emulated: no AVX-512 BF16/AMX on this CPU)"))])
def test_modes(monkeypatch, fbgemm, native_bf16, fast):
    """What each mode means, as a function of what the machine has (stubbed: every branch runs everywhere)."""
    monkeypatch.setattr(kernels, "fp16_weights_available", lambda: fbgemm)
    monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: native_bf16)
    assert mode_dtype("exact") == (torch.float32, "exact: fp32")
    assert mode_dtype("fast") == fast
    with pytest.raises(ValueError, match="exact, fast"):
        mode_dtype("turbo")


def test_row_fitted_linear_equals_f_linear_for_every_row_count():
    from tr_core.kernels import ROW_FITTED_MAX_ROWS, RowFittedLinear
    torch.manual_seed(0)
    for bias in (False, True):
        layer = torch.nn.Linear(48, 80, bias=bias)
        fitted = torch.nn.Linear(48, 80, bias=bias)
        fitted.load_state_dict(layer.state_dict())
        fitted.__class__ = RowFittedLinear
        for rows in (1, 2, 3, 5, 8, 33, ROW_FITTED_MAX_ROWS, ROW_FITTED_MAX_ROWS + 1):
            for shape in ((rows, 48), (1, rows, 48)):
                x = torch.randn(*shape)
                out = fitted(x)
                assert out.shape == (*shape[:-1], 80) and out.is_contiguous()
                torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-5)


def test_fit_linears_touches_only_fp32_body_linears_and_keeps_the_outputs():
    from tr_core.kernels import RowFittedLinear, fit_linears
    model = tiny_model("llama", dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    before = model(input_ids=ids).logits
    n = fit_linears(model)
    assert n == sum(isinstance(m, RowFittedLinear) for m in model.base_model.modules()) > 0
    assert fit_linears(model) == n  # idempotent
    assert not isinstance(model.get_output_embeddings(), RowFittedLinear)  # the head has its own kernels
    torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=1e-5, atol=1e-5)
    assert fit_linears(tiny_model("llama")) == 0  # the float64 test models keep torch's own kernels


def test_a_compiled_body_is_what_decoding_runs_and_the_output_stays_greedy():
    from conftest import reference_greedy
    from tr_core.decoding import run
    from tr_core.drafters import PlainDrafter, RecyclingDrafter
    from tr_core.kernels import body, compile_body, is_compiled
    from tr_core.matrix import AdjacencyMatrix
    from tr_core.tree import load_template
    model = tiny_model("llama", dtype=torch.float32)
    prompt = [3, 17, 42, 8, 99, 5]
    expected = reference_greedy(model, prompt, 12)
    assert not is_compiled(model)
    eager = body(model)
    compile_body(model, backend="eager")  # dynamo traces; no code generation: cheap enough for a test
    assert is_compiled(model) and body(model) is not eager and body(model) is not model.base_model
    from torch._dynamo.utils import counters
    counters.clear()
    assert run(model, prompt, PlainDrafter(), 12).token_ids == expected
    tree = load_template("small")
    matrix = AdjacencyMatrix(model.config.vocab_size, 8)
    assert run(model, prompt, RecyclingDrafter(matrix, tree), 12).token_ids == expected
    assert counters["stats"]["unique_graphs"] > 0  # decoding went through dynamo, i.e. through the compiled body


@needs_fbgemm
def test_fp16_weight_linear_rounds_only_the_weights():
    from tr_core.kernels import Fp16WeightLinear
    torch.manual_seed(0)
    for bias in (False, True):
        layer = torch.nn.Linear(48, 80, bias=bias)
        packed = Fp16WeightLinear(layer)
        rounded = torch.nn.Linear(48, 80, bias=bias)
        rounded.load_state_dict(layer.state_dict())
        with torch.no_grad():
            rounded.weight.copy_(layer.weight.half().float())  # what fp16 storage keeps of each weight
        assert not any(True for _ in packed.parameters())  # the fp32 weight is not kept
        for shape in ((1, 48), (2, 48), (1, 7, 48), (33, 48)):
            x = torch.randn(*shape)
            out = packed(x)
            assert out.shape == (*shape[:-1], 80) and out.dtype == torch.float32
            torch.testing.assert_close(out, rounded(x), rtol=1e-5, atol=1e-5)  # fp32 arithmetic on fp16 weights
            assert (out - layer(x)).abs().max() > 0  # ...which are not the fp32 weights
        x = torch.randn(8, 48)  # a row computes the same alone and in a batch, to float rounding
        torch.testing.assert_close(packed(x), torch.cat([packed(x[i:i + 1]) for i in range(8)]), rtol=1e-5, atol=1e-5)


@needs_fbgemm
def test_fast_mode_packs_the_body_and_the_head_and_stays_greedy():
    from conftest import reference_greedy
    from tr_core.decoding import run
    from tr_core.drafters import PlainDrafter, RecyclingDrafter
    from tr_core.kernels import Fp16WeightLinear, has_fp16_weights, pack_fp16_weights, prepare_model
    from tr_core.matrix import AdjacencyMatrix
    from tr_core.tree import load_template
    model = tiny_model("llama", dtype=torch.float32)
    linears = sum(type(m) is torch.nn.Linear for m in model.base_model.modules())
    prompt = [3, 17, 42, 8, 99, 5]
    prepare_model(model, "fast")
    assert has_fp16_weights(model) and pack_fp16_weights(model) == linears  # all of them, once (idempotent)
    assert not isinstance(model.get_output_embeddings(), Fp16WeightLinear)  # the head is OutputHead's
    head = OutputHead(model)
    hidden = torch.randn(3, model.config.hidden_size)
    w16 = model.get_output_embeddings().weight.detach().half().float()
    torch.testing.assert_close(head(hidden), hidden @ w16.t(), rtol=1e-5, atol=1e-5)
    expected = reference_greedy(model, prompt, 12)  # transformers' generate on the packed model
    assert run(model, prompt, PlainDrafter(), 12, head=head).token_ids == expected
    matrix = AdjacencyMatrix(model.config.vocab_size, 8)
    assert run(model, prompt, RecyclingDrafter(matrix, load_template("small")), 12, head=head).token_ids == expected
    exact = tiny_model("llama", dtype=torch.float32)
    prepare_model(exact, "exact")
    assert not has_fp16_weights(exact)


def test_cpu_models_attend_with_grouped_query_heads_under_a_tree_mask():
    import os
    from transformers.integrations.sdpa_attention import use_gqa_in_sdpa
    from tr_core.kernels import GQA_SWITCH, prepare_model
    model = tiny_model("llama", dtype=torch.float32)
    prepare_model(model, "exact")
    assert os.environ.get(GQA_SWITCH) == "1"
    key = value = torch.zeros(1, 2, 10, 16)
    mask = torch.zeros(1, 1, 3, 10)
    assert use_gqa_in_sdpa(mask, key, value), "transformers no longer reads the switch: tree steps copy the cache"

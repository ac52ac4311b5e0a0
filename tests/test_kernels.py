import torch

from conftest import tiny_model
from tr_core.kernels import OutputHead, mode_dtype


def test_output_head_equals_the_models_own_output_layer():
    for arch in ("llama", "gpt2"):
        model = tiny_model(arch, dtype=torch.float32)
        head = OutputHead(model)
        for n in (1, 2, 7):
            hidden = torch.randn(n, model.config.hidden_size if arch == "llama" else model.config.n_embd)
            torch.testing.assert_close(head(hidden), model.get_output_embeddings()(hidden), rtol=1e-5, atol=1e-5)


def test_modes():
    assert mode_dtype("exact")[0] == torch.float32
    assert mode_dtype("fast")[0] == torch.bfloat16
    try:
        mode_dtype("turbo")
    except ValueError as e:
        assert "exact, fast" in str(e)
    else:
        raise AssertionError("unknown mode accepted")

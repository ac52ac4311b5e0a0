"""The two numeric modes, for every method alike (plain decoding runs in the same mode as the one it is compared
with):

- ``exact``: fp32, the model's own numerics; outputs equal plain fp32 decoding up to float near-ties.
- ``fast``: bf16. A decoding step on a CPU is memory-bound, and bf16 halves the weight traffic: a one-token forward
  took ~38 ms in bf16 against ~60 ms in fp32 on this project's AVX2 machine (with F.linear as the output layer). Where the processor lacks native bf16 arithmetic (no AVX-512 BF16 / AMX),
  large batched forwards get slower instead, so the fitted tree (calibrated per dtype) comes out small.
"""

from __future__ import annotations

import torch

MODES = ("exact", "fast")


def cpu_has_native_bf16() -> bool:
    """True where the CPU has AVX-512 BF16 or AMX."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def mode_dtype(mode: str) -> tuple[torch.dtype, str]:
    """The dtype a mode runs in, and a sentence saying what that means on this machine."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "exact":
        return torch.float32, "exact: fp32"
    native = "native" if cpu_has_native_bf16() else "emulated: no AVX-512 BF16/AMX on this CPU"
    return torch.bfloat16, f"fast: bf16 ({native})"


class OutputHead:
    """The model's output layer, computed with the matmul layout that is fastest for the number of rows.

    The engine runs the base model (``model.base_model``) and applies this head to its final hidden states, so the
    output layer is computed only for the positions it needs (none at prefill). On CPUs, torch's ``F.linear`` for the
    49,152 x 576 output layer of the embedded model took 9.4 ms for one row and ~20 ms for 2-8 rows; ``h @ W^T``
    from a transposed copy took 5.9 ms for one row, and ``(W @ h^T)^T`` 7-10 ms for 2-8 rows. Same maths, other
    summation order: results agree to float rounding.
    """

    def __init__(self, model: torch.nn.Module):
        head = model.get_output_embeddings()
        self.weight = head.weight  # (V, d), shared with the input embedding when tied
        self.bias = getattr(head, "bias", None)
        # the layouts were chosen by fp32 timings; emulated bf16 matmuls behave differently (a one-row bf16 product
        # from the transposed copy was measured several times slower), so other dtypes keep F.linear
        self.on_cpu = self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        self._transposed = self.weight.detach().t().contiguous() if self.on_cpu else None  # (d, V), one copy

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` (n, d) -> logits (n, V)."""
        if not self.on_cpu:
            logits = torch.nn.functional.linear(hidden, self.weight)
        elif hidden.shape[0] == 1:
            logits = hidden @ self._transposed
        else:
            logits = (self.weight @ hidden.t()).t()
        return logits + self.bias if self.bias is not None else logits

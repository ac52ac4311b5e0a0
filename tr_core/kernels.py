"""The two numeric modes, for every method alike (plain decoding runs in the same mode as the one it is compared
with):

- ``exact``: fp32, the model's own numerics; outputs equal plain fp32 decoding up to float near-ties.
- ``fast``: bf16. A decoding step on a CPU is memory-bound, and bf16 halves the weight traffic: a one-token forward
  took ~38 ms in bf16 against ~60 ms in fp32 on this project's AVX2 machine (with F.linear as the output layer). Where the processor lacks native bf16 arithmetic (no AVX-512 BF16 / AMX),
  large batched forwards get slower instead, so the fitted tree (calibrated per dtype) comes out small.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

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


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` prepacked for oneDNN's linear, or None where this torch build or CPU cannot run it."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        probe = torch.ops.mkldnn._linear_pointwise(torch.ones(3, weight.shape[1]), packed, None, "none", [], "")
        if probe.shape != (3, weight.shape[0]):
            return None
        return packed
    except (AttributeError, RuntimeError):
        return None


class OutputHead:
    """The model's output layer, computed with the matmul layout that is fastest for the number of rows.

    The engine runs the base model (``model.base_model``) and applies this head to its final hidden states, so the
    output layer is computed only for the positions it needs (none at prefill). On CPUs (fp32), for the 49,152 x 576
    output layer of the embedded model, followed by the step's argmax and top-8 (measured alone, ms):

    ======  ========  ===============  =================
    rows    F.linear  (W @ h^T)^T      oneDNN prepacked
    ======  ========  ===============  =================
    2       19.9      6.1              7.7
    4       22.1      8.8              12.5
    8       23.3      15.8             14.0
    16      26.5      21.2             15.4
    32      46.5      32.9             26.2
    81      58.4      73.2             51.4
    ======  ========  ===============  =================

    and for one row (no top-k) ``h @ W^T`` from a transposed copy took 5.4 ms against 11.2 for F.linear. So: one
    row from the transposed copy, 2-5 rows as ``(W @ h^T)^T``, more rows through oneDNN where this torch build has it
    (else ``(W @ h^T)^T``, made contiguous so that the argmax and top-k read rows). Same maths, other summation order:
    results agree to float rounding.
    """

    ONEDNN_MIN_ROWS = 6

    def __init__(self, model: torch.nn.Module):
        head = model.get_output_embeddings()
        self.weight = head.weight  # (V, d), shared with the input embedding when tied
        self.bias = getattr(head, "bias", None)
        # the layouts were chosen by fp32 timings; emulated bf16 matmuls behave differently (a one-row bf16 product
        # from the transposed copy was measured several times slower), so other dtypes keep F.linear
        self.on_cpu = self.weight.device.type == "cpu" and self.weight.dtype == torch.float32
        self._transposed = self.weight.detach().t().contiguous() if self.on_cpu else None  # (d, V), one copy
        self._packed = _onednn_pack(self.weight.detach()) if self.on_cpu else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` (n, d) -> logits (n, V), contiguous."""
        rows = hidden.shape[0]
        if not self.on_cpu:
            logits = torch.nn.functional.linear(hidden, self.weight)
        elif rows == 1:
            logits = hidden @ self._transposed
        elif rows >= self.ONEDNN_MIN_ROWS and self._packed is not None:
            logits = torch.ops.mkldnn._linear_pointwise(hidden.contiguous(), self._packed, None, "none", [], "")
        else:
            logits = (self.weight @ hidden.t()).t()
            if rows >= self.ONEDNN_MIN_ROWS:
                logits = logits.contiguous()
        return logits + self.bias if self.bias is not None else logits


# Rows up to which the body's linears use the weight-streaming layout (below); prefill chunks keep F.linear.
ROW_FITTED_MAX_ROWS = 128


class RowFittedLinear(nn.Linear):
    """A ``nn.Linear`` whose forward picks the matmul layout by the number of rows, for fp32 on CPUs.

    A decoding step streams every weight from memory once, so a forward over a few tree tokens should cost about what
    one token costs. torch's ``F.linear`` does not get there: over the embedded model's 210 body linears, streamed
    from memory, it took ~36 ms for one row but 55-75 ms for 2-8 rows, while ``(W @ x^T)^T`` (the weight as the
    row-major left operand, the activations as a transposed view) took 31-44 ms for 2-5 rows and 55-60 ms for 6-16.
    One row keeps ``F.linear`` (as fast, and the exact numerics of plain decoding). Same maths: results agree to float
    rounding. Applied in place by ``fit_linears``; the parameters are untouched.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if x.dim() > 1 else 1
        if rows < 2 or rows > ROW_FITTED_MAX_ROWS:
            return super().forward(x)
        flat = x.reshape(rows, self.in_features)
        # a contiguous result: the next layer's matmul would take the slow path on a transposed view
        out = torch.mm(self.weight, flat.t()).t().contiguous()
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def fit_linears(model: nn.Module) -> int:
    """Switch the plain ``nn.Linear`` layers of ``model.base_model`` to ``RowFittedLinear`` where the weights are fp32
    on the CPU (other dtypes and devices keep their own kernels). Idempotent; returns how many layers use it."""
    count = 0
    for module in model.base_model.modules():
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32:
            module.__class__ = RowFittedLinear
        if type(module) is RowFittedLinear:
            count += 1
    return count


def compile_body(model: nn.Module, backend: str = "inductor") -> None:
    """Compile ``model.base_model`` with ``torch.compile`` (dynamic shapes) for every later decoding step.

    Most of a small model's decoding step on a CPU is not matmul: it is the Python and dispatch work of ~30 layers'
    small ops, which compilation fuses. On the embedded model (fp32, 2 cores), one run measured a one-token forward at
    40-45 ms compiled against 64-66 eager, and a 4-node tree at 50 against 73. The price is the first call of each
    shape class (one token; several tokens; several with a tree mask): 1.5-3 minutes each on 2 cores, cached on disk
    by inductor for later processes. Idempotent; see ``body``. (``backend="eager"`` traces without generating code:
    the tests use it to check the wiring cheaply.)
    """
    if model not in _COMPILED:
        _COMPILED[model] = torch.compile(model.base_model, dynamic=True, backend=backend)


# model -> its compiled body; kept beside the model, not in it, so its modules and state dict stay as loaded
_COMPILED: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def body(model: nn.Module) -> nn.Module:
    """The module a decoding step runs: the compiled base model after ``compile_body``, else ``model.base_model``."""
    compiled = _COMPILED.get(model)
    return compiled if compiled is not None else model.base_model


def is_compiled(model: nn.Module) -> bool:
    return model in _COMPILED

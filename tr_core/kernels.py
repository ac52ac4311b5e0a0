"""The two numeric modes, for every method alike (plain decoding runs in the same mode as the one it is compared
with):

- ``exact``: fp32, the model's own numerics; outputs equal plain fp32 decoding up to float near-ties.
- ``fast``: a decoding step on a CPU is memory-bound (every weight is streamed once per step), so the fast mode stores
  the weights of every linear layer in half the bytes:

  - on x86 CPUs (fbgemm): fp16 weights, fp32 activations and fp32 arithmetic (``Fp16WeightLinear``). Each weight is
    rounded once to fp16 (a relative change of at most 2^-11); nothing else changes. On this project's 2-core AVX2
    machine the embedded model's 210 body linears took 16 ms for one token against 37 ms in fp32, and 19 ms for 4
    tree tokens.
  - elsewhere: bf16 weights and activations. bf16 needs AVX-512 BF16 / AMX to be fast on a CPU: emulated (AVX2) it
    made a one-token step only ~1.2x faster than fp32 and batched tree forwards slower, and it rounds activations too,
    so tree and one-token forwards disagree at many near-ties (7 of 30 outputs equal plain bf16 decoding).
"""

from __future__ import annotations

import functools
import os
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


@functools.cache
def fp16_weights_available() -> bool:
    """True where this torch build has fbgemm's fp16-weight linear (x86 CPUs with AVX2)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(4, 8), None)
        return torch.ops.quantized.linear_dynamic_fp16(torch.ones(3, 8), packed).shape == (3, 4)
    except (AttributeError, RuntimeError):
        return False


def _linear_fp16(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    # the C++ operator itself where there is one: calling the op's packet, or even its overload, first checks in
    # Python whether to dispatch in Python (for tracing), microseconds a call, 210 calls a step of the embedded model
    global _fp16_op
    if torch.compiler.is_compiling():  # a compiled body traces the overload
        return torch.ops.quantized.linear_dynamic_fp16.default(x, packed)
    if _fp16_op is None:
        overload = torch.ops.quantized.linear_dynamic_fp16.default
        _fp16_op = getattr(overload, "_op", overload)
    return _fp16_op(x, packed)


_fp16_op = None  # the C++ operator of fbgemm's fp16-weight linear, found on first use


def mode_dtype(mode: str) -> tuple[torch.dtype, str]:
    """The dtype a mode loads the model in, and a sentence saying what the mode means on this machine."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "exact":
        return torch.float32, "exact: fp32"
    if fp16_weights_available():
        return torch.float32, "fast: fp16 weights, fp32 arithmetic"
    native = "native" if cpu_has_native_bf16() else "emulated: no AVX-512 BF16/AMX on this CPU"
    return torch.bfloat16, f"fast: bf16 ({native})"


def prepare_model(model: nn.Module, mode: str) -> None:
    """Put the model's linear layers on the kernels of ``mode`` (in place; idempotent). ``fast`` on an fp32 CPU model
    stores its linear weights in fp16 (``pack_fp16_weights``); otherwise fp32 CPU models get ``fit_linears``. CPU
    models also get ``grouped_query_attention_in_sdpa``."""
    if model.get_output_embeddings().weight.device.type == "cpu":
        grouped_query_attention_in_sdpa()
    if mode == "fast" and fp16_weights_available() and _fp32_cpu(model):
        pack_fp16_weights(model)
    else:
        fit_linears(model)


# transformers' switch for SDPA's own grouped-query attention when a mask is given (transformers.integrations.
# sdpa_attention.use_gqa_in_sdpa)
GQA_SWITCH = "TRANSFORMERS_SDPA_FORCE_GQA"


def grouped_query_attention_in_sdpa() -> None:
    """Let SDPA attend with the key/value heads as they are cached, also under a tree mask.

    Without this, transformers copies every cached key and value once per query head group (``repeat_kv``) in any
    forward with a mask: a tree step paid for a copy of the whole cache, 30 layers a step, and its cost grew with
    the context much faster than a one-token step's. Measured on the embedded model (fast mode, ms, a step's model
    work for 1 / 2 / 5 / 8 tree tokens): with a 1,024-token context 52.6 / 68.7 / 83.7 / 89.6 before and
    35.5 / 40.3 / 47.2 / 52.1 after; with 128 tokens 32.5 / 37.3 / 39.1 / 54.2 before and 31.1 / 34.9 / 36.5 / 43.6.
    SDPA's CPU kernel takes masks with ``enable_gqa``; transformers keeps the copy by default because some GPU
    kernels fall back to slow paths for that combination, so this is only switched on for CPU models. It is a
    process-wide setting (an environment variable transformers reads at every attention call); idempotent.
    """
    os.environ.setdefault(GQA_SWITCH, "1")


def _fp32_cpu(model: nn.Module) -> bool:
    weight = model.get_output_embeddings().weight
    return weight.device.type == "cpu" and weight.dtype == torch.float32


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
        # a model in the fast mode (fp16 weights in its body) gets an fp16 output layer too: 2.2 ms for one row
        # against 4.7 (fp32, transposed copy), 2.7 against 8.2 for 4 rows, 9 against 19 for 16 (argmax/top-8 included)
        self._fp16 = (torch.ops.quantized.linear_prepack_fp16(self.weight.detach(), None)
                      if self.on_cpu and has_fp16_weights(model) else None)
        self._transposed = (self.weight.detach().t().contiguous()
                            if self.on_cpu and self._fp16 is None else None)  # (d, V), one copy
        self._packed = _onednn_pack(self.weight.detach()) if self.on_cpu and self._fp16 is None else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` (n, d) -> logits (n, V), contiguous."""
        rows = hidden.shape[0]
        if not self.on_cpu:
            logits = torch.nn.functional.linear(hidden, self.weight)
        elif self._fp16 is not None:
            logits = _linear_fp16(hidden.contiguous(), self._fp16)
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
# Row counts computed as a larger count: over the embedded model's 210 body linears (fp32, (W @ x^T)^T, fastest of 3
# rounds, ms) 2 rows took 33.1, 3 rows 42.4, 4 rows 33.5, 5 rows 38.0; so 3 rows are computed as 4
ROW_PADDING = {3: 4}


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
        if rows in ROW_PADDING:  # a row count the matmul handles slowly: compute a few zero rows more, then drop them
            flat = torch.cat([flat, flat.new_zeros(ROW_PADDING[rows] - rows, self.in_features)])
        # a contiguous result: the next layer's matmul would take the slow path on a transposed view
        out = torch.mm(self.weight, flat.t())[:, :rows].t().contiguous()
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


class Fp16WeightLinear(nn.Module):
    """A linear layer whose weight is stored in fp16, packed for fbgemm; activations, accumulation and output stay
    fp32. Replaces a ``nn.Linear`` in ``pack_fp16_weights``. Its fp32 weight is dropped (the model takes about half
    the memory of its fp32 copy).

    The same row computes the same way alone or in a batch up to float rounding (one fp16 product of an 8-row batch
    was measured within 1.3e-4 of the rows computed one at a time), as with fp32's own kernels.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self._packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float().contiguous(), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = _linear_fp16(flat.contiguous(), self._packed)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp16 weights"


def pack_fp16_weights(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model.base_model`` by an ``Fp16WeightLinear`` (the output layer is
    ``OutputHead``'s). Idempotent; returns how many layers are packed."""
    for parent in list(model.base_model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu":
                setattr(parent, name, Fp16WeightLinear(child))
    return sum(isinstance(m, Fp16WeightLinear) for m in model.base_model.modules())


def has_fp16_weights(model: nn.Module) -> bool:
    return any(isinstance(m, Fp16WeightLinear) for m in model.base_model.modules())


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


# model -> its lean forward (lean.LeanLlama), made on first use
_LEAN: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


def body(model: nn.Module):
    """What a decoding step runs: the compiled base model after ``compile_body``; else, for a Llama-family model on
    the CPU, ``lean.LeanLlama`` (the same operations without transformers' per-call machinery: ~15% of a one-token
    step of the embedded model); else ``model.base_model``. All three are called alike."""
    compiled = _COMPILED.get(model)
    if compiled is not None:
        return compiled
    lean = _LEAN.get(model)
    if lean is None:
        from .lean import LeanLlama, supports

        lean = _LEAN[model] = LeanLlama(model) if supports(model) else model.base_model
    return lean


def is_compiled(model: nn.Module) -> bool:
    return model in _COMPILED

"""The two numeric modes, for every method alike (plain decoding runs in the same mode as the one it is compared
with):

- ``exact``: fp32, the model's own numerics; outputs equal plain fp32 decoding up to float near-ties.
- ``fast``: bf16. A decoding step on a CPU is memory-bound, and bf16 halves the weight traffic: one-token steps get
  faster on every x86 CPU measured here. Where the processor lacks native bf16 arithmetic (no AVX-512 BF16 / AMX),
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

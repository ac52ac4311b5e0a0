"""The two modes a model's numbers are computed in, named once (the backends, the engine, the app read them here).

    exact   fp32: the reference, every method's output checked against plain decoding's in it
    fast    half precision: on the native backend the format measured fastest on this CPU (``speed.kernels``), on
            the torch backend bf16

>>> MODES, torch_dtype("fast")
(('exact', 'fast'), torch.bfloat16)
"""

from __future__ import annotations

import torch

MODES = ("exact", "fast")


def torch_dtype(mode: str) -> torch.dtype:
    """The dtype the torch backend runs a mode in: fp32 (exact) or bf16 (fast), the same on every device."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose exact or fast")
    return torch.float32 if mode == "exact" else torch.bfloat16

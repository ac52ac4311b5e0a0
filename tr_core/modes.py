"""What the algorithm and both backends share about a model's numbers, named once (the backends, the engine, the
app read them here): the two modes, and how a step-time curve t(N) is read.

    exact   fp32: the reference, every method's output checked against plain decoding's in it
    fast    half precision: on the native backend the format measured fastest on this CPU (``speed.kernels``), on
            the torch backend bf16

>>> MODES, torch_dtype("fast")
(('exact', 'fast'), torch.bfloat16)
"""

from __future__ import annotations

import torch

MODES = ("exact", "fast")
# t(N) grows with the cached context (attention reads it); "auto" trees are fitted on t(N) at this many cached tokens,
# about a chat answer's context (``speed.calibrate.context_curve`` measures it, or averages it over several contexts)
DEFAULT_FIT_CONTEXT = 256


def torch_dtype(mode: str) -> torch.dtype:
    """The dtype the torch backend runs a mode in: fp32 (exact) or bf16 (fast), the same on every device."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose exact or fast")
    return torch.float32 if mode == "exact" else torch.bfloat16


def interpolate(curve: dict[int, float], n: int) -> float:
    """t(n) by linear interpolation between measured sizes (flat beyond the ends).

    >>> interpolate({1: 10.0, 3: 14.0}, 2), interpolate({1: 10.0, 3: 14.0}, 9)
    (12.0, 14.0)
    """
    xs = sorted(curve)
    if n <= xs[0]:
        return curve[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if n <= b:
            return curve[a] + (curve[b] - curve[a]) * (n - a) / (b - a)
    return curve[xs[-1]]

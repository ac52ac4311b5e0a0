"""The app's decoding handlers on Hugging Face's ZeroGPU: ``on_gpu(seconds)`` is ``spaces.GPU(duration=seconds)``
where the app runs on ZeroGPU (``SPACES_ZERO_GPU`` set by the Space), and leaves the handler as it is everywhere
else (``spaces.GPU`` itself does nothing off ZeroGPU; without the ``spaces`` package, nothing is imported).

On ZeroGPU, CUDA exists only inside the decorated calls and ``spaces`` must be imported before torch: ``app.py``
imports this module first. The seconds asked for a call are ``seconds(*args, **kwargs)`` of that call, from the
request's size (``live_seconds``, ``race_seconds``).
"""

from __future__ import annotations

from typing import Callable

try:  # before torch, as ZeroGPU asks
    import spaces
except ImportError:  # pragma: no cover - the requirements pin it; a bare install may lack it
    spaces = None

# a call's GPU time: the model's load and the tree's fitting at most once, then ~15 ms a token on a ZeroGPU slice
# (an estimate until measured there: docs/app.md), with room; ZeroGPU caps a call's duration
START_S, PER_TOKEN_S, MIN_S, MAX_S = 20.0, 0.05, 30, 120
RACE_ROUNDS = 3  # ui.run.Race's rounds a method


def on_gpu(seconds: Callable[..., int]) -> Callable[[Callable], Callable]:
    """``spaces.GPU(duration=seconds)`` where ``spaces`` is installed (a no-op off ZeroGPU); else the identity."""
    if spaces is None:
        return lambda fn: fn
    return spaces.GPU(duration=seconds)


def _tokens(values: dict) -> int:
    try:
        return max(1, int(values.get("max_new_tokens") or 128))
    except (TypeError, ValueError):
        return 128


def _clamp(s: float) -> int:
    return int(min(MAX_S, max(MIN_S, s)))


def live_seconds(*args, **values) -> int:
    """A Live run: the method's tokens, then plain decoding's of the same prompt.

    >>> live_seconds(max_new_tokens=128), live_seconds(max_new_tokens=4000)
    (32, 120)
    """
    return _clamp(START_S + 2 * PER_TOKEN_S * _tokens(values))


def race_seconds(*args, **values) -> int:
    """A race: every picked method and plain decoding, ``RACE_ROUNDS`` rounds each.

    >>> race_seconds(max_new_tokens=128, race_methods=["pld", "tr"])
    77
    """
    methods = len(values.get("race_methods") or ()) + 1
    return _clamp(START_S + PER_TOKEN_S * _tokens(values) * methods * RACE_ROUNDS)

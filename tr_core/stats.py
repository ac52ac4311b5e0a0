"""Run statistics, one home for the benchmark and the app's race: which round is the median, a measurement's median
and range, the bootstrap interval of a median speedup and what it says, and where two outputs first differ.

Plain Python and numpy: no torch, so the app's pages can use it as the benchmark does.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from statistics import median
from typing import Callable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")

BOOTSTRAP = {"resamples": 2000, "seed": 0, "confidence": 0.95}
# Fewer questions than this give no verdict: with so few, the bootstrap interval is little more than the ratios' range
MIN_QUESTIONS_FOR_VERDICT = 5


# The one speedup of this project: the benchmark, the race, Live and the walkthrough all compute it with ``speedup``
SPEEDUP_DEFINITION = ("a method's tokens per second over plain decoding's, on the same prompt and the same answer "
                      "length; each counts the whole answer: the prefill and every decoding step")


_PAUSED = {"holders": 0, "was_enabled": True}
_PAUSED_LOCK = threading.Lock()


@contextmanager
def collector_paused():
    """No automatic cyclic garbage collection while the block runs, in any thread; what the process owes is
    collected after it. For the timed steps of a live run and of plain decoding measured beside it, the race's runs
    and the benchmark's questions: in the app's process a full collection took up to 389 ms (measured in
    test_app.py's runs), and one inside a step would be billed to whichever method ran it, when the garbage and the
    objects scanned are the page's (or the benchmark's). Blocks may nest and
    overlap across threads; the collector comes back on when the last ends (unless it was off before the first)."""
    with _PAUSED_LOCK:
        if _PAUSED["holders"] == 0:
            _PAUSED["was_enabled"] = gc.isenabled()
            gc.disable()
        _PAUSED["holders"] += 1
    try:
        yield
    finally:
        with _PAUSED_LOCK:
            _PAUSED["holders"] -= 1
            if _PAUSED["holders"] == 0 and _PAUSED["was_enabled"]:
                gc.enable()


def speedup(tokens_per_s: float, plain_tokens_per_s: float) -> float:
    """A method's speed over plain decoding's (``SPEEDUP_DEFINITION``); 0 where plain's is unknown.

    >>> speedup(30.0, 20.0), speedup(5.0, 0.0)
    (1.5, 0.0)
    """
    return tokens_per_s / plain_tokens_per_s if plain_tokens_per_s > 0 else 0.0


def median_round(rounds: Sequence[T], seconds: Callable[[T], float]) -> T:
    """The round with the median time (of an even count, the faster of the two middle ones): a robust time that
    comes, with its steps and events, from one real decoding.

    >>> median_round([3.0, 1.0, 2.0, 4.0], seconds=float)
    2.0
    """
    return sorted(rounds, key=seconds)[(len(rounds) - 1) // 2]


@dataclass(frozen=True)
class Spread:
    """The median of a few measurements and their range.

    >>> Spread.of([1.2, 0.9, 1.1])
    Spread(median=1.1, low=0.9, high=1.2)
    """

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(median(values), min(values), max(values))

    def shown(self, digits: int = 1, unit: str = "") -> str:
        """``"14.2 (13.0–15.1)"``; with ``unit="×"``: ``"1.12× (1.05–1.18×)"``."""
        return f"{self.median:.{digits}f}{unit} ({self.low:.{digits}f}–{self.high:.{digits}f}{unit})"


def bootstrap_median_interval(values: Sequence[float], resamples: int = BOOTSTRAP["resamples"],
                              seed: int = BOOTSTRAP["seed"],
                              confidence: float = BOOTSTRAP["confidence"]) -> tuple[float, float]:
    """The percentile-bootstrap interval of the median of ``values`` (one per question): the questions drawn with
    replacement ``resamples`` times, the median of each draw, and the middle ``confidence`` of those medians.
    Seeded: the same values give the same interval.

    >>> bootstrap_median_interval([1.2, 1.2, 1.2])
    (1.2, 1.2)
    """
    x = np.asarray(values, dtype=float)
    draws = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))
    lo, hi = np.quantile(np.median(x[draws], axis=1), [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(lo), float(hi)


def verdict(interval: tuple[float, float] | None, questions: int) -> str:
    """What an interval of a speedup says: "faster" or "slower" only where it excludes 1.

    >>> verdict((1.05, 1.3), 30), verdict((0.7, 0.95), 30), verdict((0.9, 1.2), 30), verdict((1.1, 1.2), 3)
    ('faster', 'slower', 'no clear difference', 'too few questions')
    """
    if interval is None or questions < MIN_QUESTIONS_FOR_VERDICT:
        return "too few questions"
    lo, hi = interval
    return "faster" if lo > 1 else "slower" if hi < 1 else "no clear difference"


def compare(values: Sequence[float]) -> dict:
    """The median of per-question speedups, its 95% interval (none from one question) and the verdict."""
    interval = bootstrap_median_interval(values) if len(values) > 1 else None
    return {"speedup_median": round(float(np.median(values)), 4),
            "speedup_ci95": None if interval is None else [round(interval[0], 4), round(interval[1], 4)],
            "verdict": verdict(interval, len(values))}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (or where the shorter ends); ``None`` if equal.

    >>> first_difference([1, 2, 3], [1, 5, 3]), first_difference([1, 2], [1, 2, 3]), first_difference([4], [4])
    (1, 2, None)
    """
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))

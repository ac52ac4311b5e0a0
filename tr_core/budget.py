"""The tree budget, adapted online: how many draft nodes the next step verifies.

``fitting.fit_tree`` picks, once, the N likeliest nodes maximising expected tokens per second,
(1 + expected accepted draft tokens) / t(N), from t(N) calibrated in a few seconds. On a machine whose speed drifts
that verdict goes stale. ``TreeBudget`` keeps deciding, from the engine's own steps, over a few candidate sizes
(nodes, root included; the tree of size N is always the N likeliest nodes, so every size is a prefix of one order):

- step time: t(N) = speed * calibrated(N) * correction(N). ``speed`` is one machine-speed factor shared by every
  size: the steps at the size the budget exploits move it, so a slow spell seen there moves all sizes alike.
  ``correction`` is the shape of the curve against the calibrated one: an explored size's step, measured against
  ``speed`` (i.e. against the exploited size's recent steps), moves that size's correction. A size never measured
  takes the correction of the measured sizes around it (linear in N between them, flat beyond them). Both move in
  log space by an exponentially weighted step, each surprise clipped to [1/2, 2] so one stalled step cannot swing
  them.
- acceptance: ``acceptance[j]``, how often the j-th likeliest node lies on the accepted path (root = 1), starts
  from the shipped statistics; every step moves the value of each node of its tree towards 1 (on the accepted path)
  or 0 (not), exponentially weighted.
- choice: the size with the most expected tokens per second; every ``explore_every``-th step runs a neighbouring
  candidate instead (the next size up, then the next size down, in turn), so that the estimates around the choice
  stay fresh. No randomness: the same timings give the same sizes.

Plain Python over ~15 sizes: choosing and learning cost tens of microseconds a step.

>>> b = TreeBudget(sizes=[1, 2, 3], step_ms=[10.0, 10.0, 20.0], acceptance=[1.0, 0.5, 0.4], explore_every=0)
>>> b.choose()  # tokens/s: 1 / 10 ms, 1.5 / 10 ms, 1.9 / 20 ms
2
>>> for _ in range(30):  # size 2 now measures 20 ms: the machine slowed down, every size with it
...     b.observe_time(20.0)
>>> [round(t) for t in b.step_ms()], b.choose()
([20, 20, 40], 2)
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import Iterable, Sequence

# candidate sizes (nodes, root included): dense where CPUs choose, geometric beyond (the calibration's own grid)
CANDIDATE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 81)
_LOG_CLIP = math.log(2.0)


def candidate_sizes(max_nodes: int, include: Iterable[int] = ()) -> list[int]:
    """The sizes a budget chooses among: ``CANDIDATE_SIZES`` up to ``max_nodes``, with ``include`` (e.g. the
    fitted tree's size) and ``max_nodes`` itself.

    >>> candidate_sizes(7, include=[5])
    [1, 2, 3, 4, 5, 6, 7]
    """
    return sorted({n for n in CANDIDATE_SIZES if n <= max_nodes} | {n for n in include if 1 <= n <= max_nodes}
                  | {max_nodes})


def likeliest_first(acceptance: Sequence[float]) -> list[int]:
    """Node indices, root first, then the others by acceptance (likeliest first; the lower index on a tie), as
    ``fitting.fit_tree`` orders them. A child is never likelier than its parent, so each prefix is a tree.

    >>> likeliest_first([1.0, 0.2, 0.5, 0.2])
    [0, 2, 1, 3]
    """
    return [0] + sorted(range(1, len(acceptance)), key=lambda i: (-acceptance[i], i))


def expected_tokens(acceptance: Sequence[float]) -> dict[int, float]:
    """Tokens a step is expected to add with a tree of the N likeliest nodes (``likeliest_first``), for every N from 1
    to all nodes: the bonus token plus each draft node's share of steps on the accepted path.

    >>> expected_tokens([1.0, 0.2, 0.5, 0.2])
    {1: 1.0, 2: 1.5, 3: 1.7, 4: 1.9}
    """
    order, total, gain = likeliest_first(acceptance), 1.0, {1: 1.0}
    for n, node in enumerate(order[1:], start=2):
        total += acceptance[node]
        gain[n] = round(total, 12)
    return gain


def step_time(sizes: Sequence[int], step_ms: Sequence[float], nodes: int) -> float:
    """The step time (ms) of ``nodes`` nodes, linear between the candidate ``sizes``' ``step_ms``, flat below the
    first and on the last segment's slope (not below 0) beyond the last.

    >>> [step_time([1, 3], [10.0, 12.0], n) for n in range(6)]
    [10.0, 10.0, 11.0, 12.0, 13.0, 14.0]
    """
    if len(sizes) == 1 or nodes <= sizes[0]:
        return step_ms[0]
    i = min(bisect_left(sizes, nodes), len(sizes) - 1)  # the segment sizes[i - 1] .. sizes[i]
    slope = (step_ms[i] - step_ms[i - 1]) / (sizes[i] - sizes[i - 1])
    if nodes > sizes[-1]:
        return step_ms[-1] + max(slope, 0.0) * (nodes - sizes[-1])
    return step_ms[i - 1] + slope * (nodes - sizes[i - 1])


def _clipped_log(ratio: float) -> float:
    return max(-_LOG_CLIP, min(_LOG_CLIP, math.log(ratio))) if ratio > 0 else 0.0


class TreeBudget:
    """Running estimates of step time and node acceptance, and the tree size they favour.

    ``sizes``: candidate sizes (nodes, root included), ascending; ``step_ms``: calibrated t(N) at each;
    ``acceptance``: per node in likeliest-first order (``acceptance[0]`` the root), at least ``sizes[-1]`` of them;
    ``start``: the size to count as measured first (default: the best by the starting estimates).

    Per step: ``choose()`` (the size to run), then ``observe_path(positions)`` and ``observe_time(ms)`` for that
    step; ``estimates()`` gives what the choice was made from, as plain data.
    """

    def __init__(self, sizes: Sequence[int], step_ms: Sequence[float], acceptance: Sequence[float],
                 start: int | None = None, explore_every: int = 8, speed_rate: float = 0.2,
                 shape_rate: float = 0.5, acceptance_rate: float = 0.02):
        sizes = [int(n) for n in sizes]
        if not sizes or sizes[0] < 1 or any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"tree sizes must be ascending whole numbers >= 1, got {sizes}")
        if len(step_ms) != len(sizes) or not all(t > 0 for t in step_ms):
            raise ValueError("give one positive calibrated step time per size")
        if len(acceptance) < sizes[-1]:
            raise ValueError(f"acceptance covers {len(acceptance)} nodes; the largest size needs {sizes[-1]}")
        self.sizes = tuple(sizes)
        self.calibrated = tuple(float(t) for t in step_ms)
        self.correction = [1.0] * len(sizes)
        self.measured = [False] * len(sizes)
        self.acceptance = [float(a) for a in acceptance[:sizes[-1]]]
        self.speed = 1.0
        self.explore_every, self.speed_rate, self.shape_rate = explore_every, speed_rate, shape_rate
        self.acceptance_rate = acceptance_rate
        self.steps = self._explorations = 0
        self._step_ms, self._tokens = self._estimate()
        best = self._best() if start is None else self.sizes.index(start)
        self.measured[best] = True
        self.current, self.best, self.exploring = best, best, False

    # --- estimates ------------------------------------------------------------------------------------------------

    def _correction(self, i: int) -> float:
        """The measured correction at candidate ``i``, or interpolated between the measured ones around it."""
        if self.measured[i]:
            return self.correction[i]
        lo = next((j for j in range(i - 1, -1, -1) if self.measured[j]), None)
        hi = next((j for j in range(i + 1, len(self.sizes)) if self.measured[j]), None)
        if lo is None or hi is None:
            return self.correction[hi if lo is None else lo] if (lo, hi) != (None, None) else 1.0
        f = (self.sizes[i] - self.sizes[lo]) / (self.sizes[hi] - self.sizes[lo])
        return self.correction[lo] + f * (self.correction[hi] - self.correction[lo])

    def _estimate(self) -> tuple[list[float], list[float]]:
        """Step time (ms) and expected tokens per step (bonus included) at every candidate size."""
        step_ms = [self.speed * c * self._correction(i) for i, c in enumerate(self.calibrated)]
        tokens, total, n = [], 0.0, 0
        for size in self.sizes:
            while n < size:
                total += self.acceptance[n]  # acceptance[0] = the root's, standing for the bonus token
                n += 1
            tokens.append(total)
        return step_ms, tokens

    def _best(self) -> int:
        rates = [t / ms for t, ms in zip(self._tokens, self._step_ms)]
        return max(range(len(rates)), key=lambda i: (rates[i], -i))  # the smaller size on a tie

    def step_ms(self) -> list[float]:
        """The estimated step time (ms) at every candidate size, now."""
        return self._estimate()[0]

    def tokens_per_s(self) -> list[float]:
        step_ms, tokens = self._estimate()
        return [1e3 * t / ms for t, ms in zip(tokens, step_ms)]

    def estimates(self) -> dict:
        """What the latest ``choose()`` saw, as plain data (sizes in draft nodes, the root not counted):
        ``{"sizes", "step_ms", "expected_tokens" (per step, bonus included), "tokens_per_s", "best" (the size with
        the most expected tokens/s), "explored" (whether this step runs a neighbour of it instead), "speed"}``."""
        return {
            "sizes": [n - 1 for n in self.sizes],
            "step_ms": [round(t, 3) for t in self._step_ms],
            "expected_tokens": [round(t, 4) for t in self._tokens],
            "tokens_per_s": [round(1e3 * t / ms, 3) for t, ms in zip(self._tokens, self._step_ms)],
            "best": self.sizes[self.best] - 1,
            "explored": self.exploring,
            "speed": round(self.speed, 4),
        }

    # --- one step -------------------------------------------------------------------------------------------------

    def choose(self) -> int:
        """The size (nodes, root included) to run this step: the best by the estimates, or on every
        ``explore_every``-th step its neighbour (up, then down, in turn; the only one at either end)."""
        self._step_ms, self._tokens = self._estimate()
        self.best = best = self._best()
        self.steps += 1
        last = len(self.sizes) - 1
        self.exploring = bool(self.explore_every) and last > 0 and self.steps % self.explore_every == 0
        if self.exploring:
            up = self._explorations % 2 == 0
            self._explorations += 1
            self.current = best + 1 if (up and best < last) or best == 0 else best - 1
        else:
            self.current = best
            self.measured[best] = True  # the exploited size anchors the corrections around it
        return self.sizes[self.current]

    def observe_time(self, ms: float) -> None:
        """The measured step time (ms) of the size last chosen: on an exploited step it moves the shared speed
        factor, on an explored one that size's correction."""
        i = self.current
        correction = self._correction(i)
        surprise = _clipped_log(ms / (self.speed * self.calibrated[i] * correction))
        if self.exploring:
            self.correction[i] = correction * math.exp(self.shape_rate * surprise)
            self.measured[i] = True
        else:
            self.speed *= math.exp(self.speed_rate * surprise)

    def running(self, index: int, exploring: bool = False) -> None:
        """The candidate size (``sizes[index]``) that the next ``observe_path`` and ``observe_time`` learn about, for
        a drafter that sizes its own tree (the best-first and context drafters) and so runs a size ``choose`` did
        not pick: ``exploring`` as on a step that tries a neighbour of the best size."""
        self.current, self.exploring = index, exploring

    def observe_scaled_time(self, ms: float, nodes: int, step_ms: Sequence[float] | None = None) -> None:
        """A step of ``nodes`` nodes (root included) took ``ms``: learn it as the time of the size running, scaled
        by the estimated step times ``step_ms`` (those the step was sized by; default: the estimates now)."""
        estimated = list(step_ms) if step_ms is not None else self.step_ms()
        self.observe_time(ms * estimated[self.current] / step_time(self.sizes, estimated, nodes))

    def observe_path(self, positions: Iterable[int]) -> None:
        """The step's accepted draft nodes, as positions in likeliest-first order (1 = the likeliest): each node of
        the size last chosen moves towards 1 if it was on the accepted path, else towards 0."""
        rate, acc = self.acceptance_rate, self.acceptance
        keep = 1.0 - rate
        for j in range(1, self.sizes[self.current]):
            acc[j] *= keep
        for j in positions:
            acc[j] += rate


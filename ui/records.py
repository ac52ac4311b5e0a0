"""The app's run records, plain data from step events: a measured race run and the race's summary over its rounds
(medians and ranges, ``tr_core.stats``), and plain decoding's speed beside a live run. Shared by the runs
(``ui.run``), the session (``ui.session``) and the HTML (``ui.render``)."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Mapping, Sequence

from tr_core.events import Rates, StepEvent
from tr_core.stats import Spread, median_round, speedup


def ms_per_step(events: Sequence[StepEvent]) -> float:
    """The mean time of one decoding step (forward pass and overhead), in ms; plain decoding's is its ms per token."""
    return sum(e.forward_ms + e.overhead_ms for e in events) / len(events) if events else 0.0


@dataclass(frozen=True)
class Baseline:
    """Plain decoding's speed on this machine, measured in the session, and where the number comes from."""

    tokens_per_s: float  # over the whole answer, prefill included (tr_core.stats.SPEEDUP_DEFINITION)
    ms_per_token: float  # its decoding steps' mean time
    source: str  # e.g. "plain decoding of your prompt, measured right after your run: ..." (ui.run.PlainAlongside)
    identical: bool | None = None  # whether plain decoding gave the run's very tokens
    final: bool = True  # False while the run goes on: plain decoding's speed so far
    # while plain decoding is measured after the run (not final): the run's own tokens/s over its first steps that
    # reached plain decoding's token count so far, so that the speedup so far compares the same stretch of the answer
    run_tokens_per_s: float | None = None


@dataclass(frozen=True)
class RaceRun:
    """One method's measured run: its events and the text and token ids they produced."""

    method: str
    events: list[StepEvent]

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for t in e.new_tokens]

    @property
    def text(self) -> str:
        return "".join(e.new_text for e in self.events)

    @property
    def elapsed_s(self) -> float:
        return self.events[-1].elapsed_s if self.events else 0.0

    @property
    def rates(self) -> Rates:
        return self.events[-1].rates if self.events else Rates()


@dataclass(frozen=True)
class RaceSummary:
    """One method over a race's rounds. Each round's run is set against plain decoding's run of the same round
    (measured minutes apart at most, on the same CPU): its speedup, and what one of its forward passes cost against
    one of plain's (a one-token pass)."""

    method: str
    rounds: int
    tokens_per_s: Spread
    speedup: Spread  # each round's tokens/s over plain's in that round
    tokens_per_pass: float  # the median round's tokens per forward pass, the bonus token included
    pass_cost: float  # median over rounds: the mean decoding step's time over plain's (1.0 for plain itself)
    steps: int  # the median round's decoding steps
    identical: bool  # every round's output equals plain decoding's (of the first round)


def median_run(runs: Sequence[RaceRun]) -> RaceRun:
    """The round with the median time (``stats.median_round``, as the benchmark takes it): the run the replay
    shows."""
    return median_round(runs, seconds=lambda r: r.elapsed_s)


def race_summary(rounds: Mapping[str, Sequence[RaceRun]]) -> dict[str, RaceSummary]:
    """Every method's medians and ranges over the race's rounds (``{method: [run of round 1, round 2, ...]}``, plain
    decoding's under ``"plain"``, each list in round order)."""
    plain = rounds["plain"]
    summary = {}
    for method, runs in rounds.items():
        typical = median_run(runs)
        speedups = [speedup(r.rates.tokens_per_s, p.rates.tokens_per_s) for r, p in zip(runs, plain)]
        costs = [ms_per_step(r.events) / ms_per_step(p.events) if ms_per_step(p.events) else 0.0
                 for r, p in zip(runs, plain)]
        summary[method] = RaceSummary(method, len(runs), Spread.of([r.rates.tokens_per_s for r in runs]),
                                      Spread.of(speedups), typical.rates.mean_accepted_tokens, median(costs),
                                      len(typical.events), all(r.token_ids == plain[0].token_ids for r in runs))
    return summary

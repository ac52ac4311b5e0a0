"""Spec-Bench benchmark: every method on the same questions, in rounds alternating the methods, in shards on workers.

    python -m tr_core.tools.bench [--questions FILE] [--per-category 5] [--max-new-tokens 128] [--rounds 3]
                            [--methods plain,pld,tr,tr-paper] [--model ID] [--mode exact|fast]
                            [--out bench_out] [--temperatures 0,0.3,0.7,1.0 --seed 0]

    python -m tr_core.tools.bench ... --ray [ADDRESS] [--workers N] [--threads T] [--shards S]
    python -m tr_core.tools.bench --resume FOLDER [--ray ...]

The questions are dealt into shards stratified by category; each shard is decoded by one worker (``BenchWorker``: the
model loaded once, t(N) measured and the trees fitted where it runs), in this process or, with ``--ray``, on Ray
actors (``workers``), so every ratio is measured inside one machine. Every finished question is written to
``--out`` as it finishes (``run_folder``), and ``--resume`` goes on from there.

It writes ``results.json`` and ``report.md`` to ``--out``. The charts are drawn from ``results.json`` by
``visualize``, which this package does not import: ``python benchmark.py`` (beside ``app.py``) takes the same
options, runs this benchmark, then draws ``speedup.html`` and ``tree_size.html``.

Methods: ``plain`` (greedy, one token per forward), ``pld`` (Prompt Lookup), ``tr`` (Token Recycling with the tree
fitted to this machine, matrix seeded from each prompt), ``tr-paper`` (the paper's 81-node tree), and ``tr-cold``
(the fitted tree from an empty matrix on every question); beyond the paper (``methods.py``): ``suffix`` (drafts from the
context's suffix index alone, a third baseline), ``tr-context``, ``tr-dynamic`` and ``tr-plus``. Token Recycling starts
from the shipped hot-start matrix and carries it across questions, as the paper's hot start does. All methods share
one model in one mode, so speedups compare like with like.

The machine drifts (its speed moves by up to 2x within minutes), so the methods are measured close together in time:
each question is decoded ``--rounds`` times by every method, each round running every method once, in an order
rotated from round to round (``round_orders``). Every round of a question starts Token Recycling from the same
matrix, the one it held before the question; what the first round taught is carried to the next question
(``measure_question``). A method's time on a question is its median round. Its speedup over plain is the median of
the per-question ratios (its tokens/s over plain's on the same question) with a 95% bootstrap interval over the
questions, and a verdict read from the interval (``compare``); the same for each pair of the other methods.
``speedup`` keeps its old meaning: mean per-question tokens/s of a method / that of ``plain``.

With ``--temperatures`` the whole measurement runs once per temperature (sampled with ``--seed``; 0 is greedy),
each from fresh hot-start matrices, and every method's output is compared with plain sampling's at the same
temperature and seed. ``results.json`` then also holds ``temperatures`` (per temperature and method: the median
speedup, mean accepted tokens, identical-to-plain count) and the report a table per temperature; the rest of the
report and of ``results.json`` is the first temperature's.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import pickle
import signal
import socket
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from ..backend import add_device_arguments, device_name
from ..decoding import DecodeResult
from ..engine import Engine, EngineConfig
from ..fixed.timing import rows_curve
from ..methods import METHODS, NAMES
from ..models import encode_prompt
from ..modes import interpolate
from ..sampling import Sampling
from ..spec_bench import Question, load_questions, stratified
from ..speed.calibrate import context_curve, context_weights, describe_context
from ..speed.layouts import cpu_name
from ..stats import BOOTSTRAP, MIN_QUESTIONS_FOR_VERDICT, SPEEDUP_DEFINITION, collector_paused, compare, median_round
from ..stats import first_difference as first_difference_at
from .report import report
from .results import (
    Record,
    pairwise,
    predicted_vs_measured,
    ratios,
    round_spread_pct,
    speedup_on,
    summarize,
    temperature_summary,
    through_run_sizes,
)
from .run_folder import RunFolder, RunFolderError, plan_shards
from .workers import LocalPool, Unit, drive

UNPADDED = "plain-unpadded"  # the torch backend's plain decoding at one row a pass (a speed baseline, not a method)
ALL_METHODS = NAMES  # every method of the registry
DEFAULT_METHODS = ("plain", "pld", "tr", "tr-paper")
DEFAULT_ROUNDS = 3  # the fewest rounds whose median ignores one round hit by a slow spell


@dataclass
class MethodRunner:
    name: str
    engine: Engine
    method: str
    reset_each_question: bool = False
    records: list[Record] = field(default_factory=list)
    sampling: Sampling | None = None  # how every run of this runner chooses tokens (None: greedy)

    @property
    def carries_matrix(self) -> bool:
        """Whether the runner's matrix goes from one question to the next (Token Recycling's hot start)."""
        return METHODS[self.method].uses_matrix and not self.reset_each_question

    def run(self, ids: list[int], max_new_tokens: int, engine: Engine | None = None) -> DecodeResult:
        """Decode one prompt on the runner's engine (or ``engine``); a cold runner starts from an empty matrix. The
        garbage collector is paused while it decodes (``stats.collector_paused``), as ``timeit`` does: a full
        collection scans every object the benchmark holds (every method's events so far; one took 240 ms in a run
        here), and one inside a timed question is billed to whichever method ran it; the collections run between
        runs."""
        if engine is None:
            engine = self.engine.with_matrix(self.engine.fresh_matrix()) if self.reset_each_question else self.engine
        with collector_paused():
            if self.sampling is None:
                return engine.generate(ids, max_new_tokens, method=self.method)
            return engine.generate(ids, max_new_tokens, method=self.method, sampling=self.sampling)


def _sized(name: str) -> bool:
    """``tr-N``: Token Recycling with the N likeliest nodes of the acceptance statistics (root included)."""
    return name.startswith("tr-") and name[3:].isdigit()


def step_curve(engine: Engine, context, remeasure: bool = False, use_cache_file: bool = True,
               sizes=None) -> dict[int, float]:
    """t(N) of the engine's backend, measured now (``remeasure``) or read from the machine's cache: the native
    backend's ``calibrate.context_curve``, the torch backend's ``fixed.timing.rows_curve``."""
    if engine.backend_name == "torch":
        prefix = context if isinstance(context, int) else round(statistics.mean(context))
        return rows_curve(engine.model, prefix, sizes=sizes, use_cache_file=use_cache_file and not remeasure)
    extra = {} if sizes is None else {"sizes": sizes}
    return context_curve(engine.model, context, remeasure=remeasure, use_cache_file=use_cache_file, **extra)


def build_runners(base: Engine, methods: list[str], hot: Path | None,
                  sampling: Sampling | None = None) -> list[MethodRunner]:
    runners = _runners(base, methods, hot)
    for r in runners:
        r.sampling = sampling
    return runners


def _runners(base: Engine, methods: list[str], hot: Path | None) -> list[MethodRunner]:
    """One runner a method, configured from the registry (``methods.METHODS``: the drafter, tree, seeding and hot
    start each runs with) over the benchmark's own defaults: the matrix methods from the hot start ``hot``, on the
    fitted tree, seeded from the prompt; the others on no tree."""
    matrix = str(hot) if hot else None
    runners = []
    for name in methods:
        if _sized(name):
            runners.append(MethodRunner(name, base.with_config(method="tr", tree=f"auto-{name[3:]}",
                                                               matrix_path=matrix, seed_from_prompt=True), "tr"))
            continue
        if name not in METHODS:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(ALL_METHODS)}, or tr-N")
        spec = METHODS[name]
        settings = ({"tree": "auto", "matrix_path": matrix, "seed_from_prompt": True} if spec.uses_matrix
                    else {"tree": "tiny"})
        runners.append(MethodRunner(name, base.with_config(**(settings | spec.settings())), spec.drafts,
                                    reset_each_question=spec.cold_start))
        if name == "plain" and base.backend_name == "torch" and base.rows != 1:  # plain unpadded: one row a pass
            runners.append(MethodRunner(UNPADDED, base.with_config(method="plain", tree="tiny", rows=1), "plain"))
    return runners


def question_contexts(prompt_lengths: list[int], max_new_tokens: int) -> tuple[int, ...]:
    """Each question's typical context in decoding: its prompt plus half the new tokens."""
    return tuple(n + max_new_tokens // 2 for n in prompt_lengths)


def round_orders(names: Sequence[str], rounds: int, question: int) -> list[list[str]]:
    """The order the methods run in on the ``question``-th question, round by round: every method once a round, the
    order rotated by one place from each round to the next and on across questions, so that each method takes every
    place in turn and a drift within a round hits them alike.

    >>> round_orders(["plain", "pld", "tr"], 2, 0)
    [['plain', 'pld', 'tr'], ['pld', 'tr', 'plain']]
    >>> round_orders(["plain", "pld", "tr"], 2, 1)  # the rotation goes on from where question 0 left it
    [['tr', 'plain', 'pld'], ['plain', 'pld', 'tr']]
    """
    n = len(names)
    return [[names[(start + i) % n] for i in range(n)] for start in range(question * rounds, (question + 1) * rounds)]


def measure_question(runners: Sequence[MethodRunner], ids: list[int], max_new_tokens: int, rounds: int,
                     question: int, on_run: Callable[[], None] = lambda: None) -> dict[str, list[DecodeResult]]:
    """Decode one prompt ``rounds`` times with every runner, in the orders of ``round_orders``; each runner's results,
    in round order (``on_run`` is called after each decoding).

    Every round of a runner that carries its matrix starts from a copy of the matrix the runner held before the
    question, so that no round drafts from what an earlier round of the same question taught it (the rounds measure
    the same decoding). After the question the runner keeps the matrix its first round taught: the hot start carried
    to the next question is what one pass over the questions would carry."""
    by_name = {r.name: r for r in runners}
    before = {r.name: r.engine.matrix.clone() for r in runners if r.carries_matrix}
    taught = {}
    results: dict[str, list[DecodeResult]] = {name: [] for name in by_name}
    for order in round_orders(list(by_name), rounds, question):
        for name in order:
            engine = by_name[name].engine.with_matrix(before[name].clone()) if name in before else None
            results[name].append(by_name[name].run(ids, max_new_tokens, engine))
            if engine is not None:
                taught.setdefault(name, engine.matrix)
            on_run()
    for name, matrix in taught.items():
        by_name[name].engine = by_name[name].engine.with_matrix(matrix)
    return results


@torch.inference_mode()
def first_difference(engine: Engine, ids: list[int], plain: list[int], other: list[int]) -> dict:
    """Where an output first leaves plain decoding's, and the two tokens' logits there (from a forward over the
    common prefix): a near-tie shows as a tiny gap."""
    k = first_difference_at(plain, other)
    logits = engine.model(input_ids=torch.tensor([ids + plain[:k]], device=engine.model.device)).logits[0, -1].float()
    out = {"position": k, "plain_token": plain[k] if k < len(plain) else None,
           "method_token": other[k] if k < len(other) else None}
    for key in ("plain_token", "method_token"):
        if out[key] is not None:
            out[key.replace("token", "logit")] = round(float(logits[out[key]]), 5)
    if "plain_logit" in out and "method_logit" in out:
        out["gap"] = round(abs(out["plain_logit"] - out["method_logit"]), 5)
    return out


def parser(prog: str = "python -m tr_core.tools.bench") -> argparse.ArgumentParser:
    """The benchmark's options (``benchmark.py`` adds its own to them)."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("--questions", default=None, help="JSON-lines questions (default: the Spec-Bench copy in assets/)")
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help="how many times every method decodes each question, the methods alternated in each round; "
                        "a method's time on a question is its median round. The run takes about this many times "
                        f"one pass (default {DEFAULT_ROUNDS}; 1 is the old single pass)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from {', '.join(ALL_METHODS)}, and tr-N (the N likeliest nodes, to compare "
                        "tree sizes)")
    p.add_argument("--model", default=None)
    p.add_argument("--mode", choices=("exact", "fast"), default="exact")
    add_device_arguments(p)
    p.add_argument("--fit-context", type=int, default=None,
                   help="the context length (tokens) the auto tree's t(N) is calibrated on (default: t(N) averaged "
                        "over the questions' contexts, each its prompt plus half the new tokens)")
    p.add_argument("--out", default="bench_out", help="the folder results.json and report.md go to")
    p.add_argument("--temperatures", default=None,
                   help="comma-separated sampling temperatures, e.g. 0,0.3,0.7,1.0 (0: greedy): the benchmark runs "
                        "once per temperature and reports each (default: greedy only, as before)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed of --temperatures (default 0)")
    p.add_argument("--recalibrate-every", type=int, default=10,
                   help="measure t(N) again after every this many questions (0: only before and after the run), for "
                        "the prediction from t(N) through the run (default 10)")
    p.add_argument("--shards", type=int, default=None,
                   help="deal the questions into this many shards, stratified by category: a shard is decoded on one "
                        "worker, the hot-start matrix carried across its questions, each shard from the shipped hot "
                        "start (default: one per 24 questions, whatever the workers, so that a run's results do "
                        "not depend on how many decode it)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run the shards on Ray workers: a local Ray on this machine's cores (no ADDRESS), or the "
                        "running cluster at ADDRESS (e.g. ray://head:10001 or auto); every ratio is still measured "
                        "inside one worker")
    p.add_argument("--workers", type=int, default=None,
                   help="how many Ray workers (default: as many as the cluster's CPUs hold, --threads each)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of each worker; with --ray, the CPUs each worker reserves (default: torch's "
                        "own without --ray, 1 with it)")
    p.add_argument("--resume", default=None, metavar="FOLDER",
                   help="go on with the run whose folder this is (its --out), skipping the questions already in its "
                        "questions.jsonl; the run's own options are kept")
    p.add_argument("--report-so-far", action="store_true",
                   help="with --resume: decode nothing, write the report of the questions finished so far "
                        "(report_so_far.md, results_so_far.json in the run's folder)")
    return p


def parse_temperatures(text: str | None) -> list[float | None]:
    """``--temperatures`` as a list (``[None]``: not given, greedy as before).

    >>> parse_temperatures("0, 0.7,1"), parse_temperatures(None)
    ([0.0, 0.7, 1.0], [None])
    """
    if text is None:
        return [None]
    values = [float(t) for t in text.split(",") if t.strip()]
    if not values or any(t < 0 for t in values):
        raise ValueError(f"--temperatures takes numbers >= 0, separated by commas; got {text!r}")
    return values


def record(question: Question, name: str, rounds: list[DecodeResult], plain_ids: list[int], base: Engine,
           ids: list[int]) -> Record:
    """A method's record of one question from its rounds: the median round, every round's time, and whether every
    round's output equals plain decoding's (the first that does not is looked at)."""
    res = median_round(rounds, seconds=lambda r: r.elapsed_s)
    differs = next((r.token_ids for r in rounds if r.token_ids != plain_ids), None)
    return Record(question.question_id, question.category, name, len(res.token_ids), res.steps, res.elapsed_s,
                  differs is None, [len(e.new_tokens) for e in res.events], sum(e.forward_ms for e in res.events),
                  sum(e.overhead_ms for e in res.events),
                  None if differs is None else first_difference(base, ids, plain_ids, differs),
                  [round(r.elapsed_s, 4) for r in rounds], sum(len(e.tree_tokens) - 1 for e in res.events))


XZ_MAGIC = b"\xfd7zXZ\x00"
EXIT_ONCE = "TR_BENCH_EXIT_ONCE"  # a test hook: "MARKER:QUESTION_ID" ends a worker's process once, mid-question
# The options that set what a run measures; --resume takes them from the run's plan. The others (where the run's
# folder is, which workers run it) may change from one session of a run to the next.
SESSION_OPTIONS = ("out", "resume", "ray", "workers", "threads", "report_so_far")


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    if "plain" not in methods:
        methods.insert(0, "plain")  # speedups are over plain decoding
    return methods


class BenchWorker:
    """One worker's part of a run: it loads the model once, measures t(N) on its own machine and fits its trees on
    it, warms up, then decodes the questions it is given, one call each, every method in rounds (``measure_question``).

    A call names its unit (temperature, shard), the question's place in the shard and the state the unit carries to
    it (``state``: the bytes the previous call returned; None at place 0). The worker holds the unit's runners between
    calls, so the state is only read when a call does not follow on from the worker's last one: after a restart, or
    when another worker ran the unit before. In the process (no Ray) or as a Ray actor (``bench_ray``)."""

    def __init__(self, options: dict, questions: list[dict], name: str = "w0", threads: int | None = None):
        if threads:
            torch.set_num_threads(threads)
        args = self.args = argparse.Namespace(**options)
        self.name = name
        self.worker_id = f"{name}-{socket.gethostname()}-{os.getpid()}"
        self.samplings = [None if t is None else Sampling(t, seed=args.seed)
                          for t in parse_temperatures(args.temperatures)]
        self.questions = {q["question_id"]: Question(**q) for q in questions}
        base = Engine.load(args.model, EngineConfig(method="plain", tree="tiny", mode=args.mode, device=args.device,
                                                    backend=args.backend, rows=args.rows))
        self.prompts = {qid: encode_prompt(base.tokenizer, q.prompt) for qid, q in self.questions.items()}
        # the tree is fitted for the contexts these questions decode over: a typical step of each sees its prompt and
        # about half of its answer, and t(N) is averaged over them (a step's cost is not linear in its context)
        self.fit_context = args.fit_context or question_contexts([len(ids) for ids in self.prompts.values()],
                                                                 args.max_new_tokens)
        self.base = base = base.with_config(fit_context=self.fit_context)
        self.hot = Path(base.shipped_matrix_path()) if base.shipped_matrix_path() else None
        load_before = os.getloadavg()[0]
        # t(N) measured anew now, before the engines fit their trees on it: a calibration cached hours ago, on a
        # shared machine, is no prediction for this run (measured again after the run, to show how far it moved)
        self.curve = step_curve(base, self.fit_context, remeasure=True)
        self.templates = build_runners(base, parse_methods(args.methods), self.hot, self.samplings[0])
        warm = "Say hello in one short sentence."
        for r in self.templates:  # warm-up, on a throwaway copy of the matrix
            r.run(base.encode(warm), 16, r.engine.with_matrix(r.engine.matrix.clone()))
        self._learned = pickle.dumps({r.name: r.engine.learners for r in self.templates})  # after the warm-up
        self._start = {r.name: r.engine.matrix for r in self.templates if r.carries_matrix}
        # t(N) sampled through the run, at the sizes the fitted trees run: the machine's cost curve moves within
        # minutes (t(4) / t(1) went from 1.10 to 1.24 during one 6-minute run here), which one calibration misses
        self.sizes = through_run_sizes([r.engine.tree.size for r in self.templates if r.engine.fitted], self.curve)
        self.through = [{n: interpolate(self.curve, n) for n in self.sizes}]
        self.ran = 0
        self.held: tuple[tuple[int, int], int, list[MethodRunner]] | None = None
        self.exit_once = options.get("exit_once")
        fitted = next((r.engine.fitted for r in self.templates if r.engine.fitted), None)
        self.info = {
            "kind": "worker", "worker_id": self.worker_id, "worker": name, "host": socket.gethostname(),
            "pid": os.getpid(), "machine": device_name(base.model.device), "cpu": cpu_name(),
            "device": str(base.model.device), "threads": torch.get_num_threads(), "dtype": str(base.model.dtype),
            "mode_note": base.mode_note(), "backend": base.backend_name, "backend_note": base.backend.describe(),
            "rows": base.rows, "load_average_before": round(load_before, 2), "t_n_ms": self.curve,
            "fit_context": describe_context(self.fit_context),
            "fit_context_weights": None if isinstance(self.fit_context, int) else {
                str(g): round(w, 4) for g, w in context_weights(self.fit_context).items()},
            "hot_start": self.hot.name if self.hot else None, "round_order": [r.name for r in self.templates],
            "lookahead_size": next((r.engine.lookahead_size() for r in self.templates if r.name == "lookahead"),
                                   None),
            "fitted_tree": None if not fitted else {
                "nodes": fitted.tree.size, "depth": fitted.tree.max_depth,
                "node_paths": [list(p) for p in fitted.tree.node_paths],
                "predicted_mean_accepted_tokens": round(fitted.expected_accepted, 4),
                "predicted_speedup": round(fitted.predicted_speedup, 4), "table": fitted.table},
            "trees": {r.name: {"method": r.method, "nodes": r.engine.tree.size, **({
                "predicted_mean_accepted_tokens": round(r.engine.fitted.expected_accepted, 4),
                "predicted_speedup": round(r.engine.fitted.predicted_speedup, 4)} if r.engine.fitted else {})}
                for r in self.templates if r.method == "tr"},
        }
        self.introduced = False

    def ready(self) -> dict:
        """What the worker is (a Ray actor answers once it has set up)."""
        return self.info

    def _fresh(self, temperature: int) -> list[MethodRunner]:
        """The runners of a unit's first question: the hot-start matrices, what the warm-up taught."""
        learned = pickle.loads(self._learned)
        runners = []
        for t in self.templates:
            engine = t.engine.with_matrix(t.engine.fresh_matrix())
            engine.learners = learned[t.name]
            runners.append(MethodRunner(t.name, engine, t.method, t.reset_each_question,
                                        sampling=self.samplings[temperature]))
        return runners

    def state(self, runners: list[MethodRunner]) -> bytes:
        """What a unit carries to its next question: each carried matrix as its rows changed since the hot start,
        and every runner's learners (tree budgets, branch acceptance; shared objects stay shared)."""
        # xz-compressed: a carried matrix's changed rows grow through a shard (950 kB raw, 190 kB compressed, for
        # five matrices after 25 questions here), and the run's folder may be kept in git between sessions
        return lzma.compress(pickle.dumps({"matrices": {r.name: r.engine.matrix.delta_from(self._start[r.name])
                                                        for r in runners if r.carries_matrix},
                                           "learners": {r.name: r.engine.learners for r in runners}}))

    def _restored(self, temperature: int, state: bytes) -> list[MethodRunner]:
        saved = pickle.loads(lzma.decompress(state) if state.startswith(XZ_MAGIC) else state)
        runners = self._fresh(temperature)
        for r in runners:
            if r.name in saved["matrices"]:
                r.engine = r.engine.with_matrix(saved["matrices"][r.name].applied_to(self._start[r.name]))
            r.engine.learners = saved["learners"][r.name]
        return runners

    def run_question(self, unit: tuple[int, int], position: int, question_id: int,
                     state: bytes | None) -> tuple[dict, bytes]:
        """Decode one question of ``unit`` at ``position`` with every method; its line for ``questions.jsonl`` and
        the state the unit carries to its next question."""
        unit = tuple(unit)
        if self.held and self.held[:2] == (unit, position):
            runners = self.held[2]
        elif state is not None:
            runners = self._restored(unit[0], state)
        elif position == 0:
            runners = self._fresh(unit[0])
        else:
            raise ValueError(f"unit {unit} at place {position} needs the state its earlier questions left")
        q, ids = self.questions[question_id], self.prompts[question_id]
        on_run = self._exit_hook(question_id)
        rounds = measure_question(runners, ids, self.args.max_new_tokens, self.args.rounds, position, on_run)
        plain_ids = median_round(rounds["plain"], seconds=lambda r: r.elapsed_s).token_ids  # every round alike
        records = {r.name: asdict(record(q, r.name, rounds[r.name], plain_ids, self.base, ids)) for r in runners}
        self.ran += 1
        every = self.args.recalibrate_every
        if unit[0] == 0 and every and self.ran % every == 0:
            self.through.append(step_curve(self.base, self.fit_context, use_cache_file=False, sizes=self.sizes))
        line = {"temperature_index": unit[0], "shard": unit[1], "position": position, "question_id": question_id,
                "category": q.category, "worker_id": self.worker_id, "machine": self.info["machine"],
                "threads": self.info["threads"], "plain_token_ids": plain_ids, "records": records}
        if not self.introduced:  # a worker's first line says what it is (a restarted worker says so again)
            line["worker_info"], self.introduced = self.info, True
        self.held = (unit, position + 1, runners)
        return line, self.state(runners)

    def _exit_hook(self, question_id: int) -> Callable[[], None]:
        """The test hook of ``EXIT_ONCE``: end this process after the first decoding of the question, once."""
        if not self.exit_once or int(self.exit_once.rsplit(":", 1)[1]) != question_id:
            return lambda: None
        marker = Path(self.exit_once.rsplit(":", 1)[0])

        def end():
            if not marker.exists():
                marker.write_text(self.worker_id)
                os._exit(3)
        return end

    def finish(self) -> dict:
        """t(N) after the worker's questions, and the mean of its calibrations through them."""
        after = step_curve(self.base, self.fit_context, use_cache_file=False)
        through = self.through + [{n: interpolate(after, n) for n in self.sizes}]
        return {"kind": "worker_end", "worker_id": self.worker_id, "t_n_ms_after_run": after,
                "t_n_ms_through_run": {n: statistics.mean(c[n] for c in through) for n in self.sizes},
                "t_n_calibrations_through_run": len(through), "load_average_after": round(os.getloadavg()[0], 2),
                "questions": self.ran}


def resumed_options(p: argparse.ArgumentParser, args: argparse.Namespace, plan: dict) -> argparse.Namespace:
    """``args`` of a ``--resume`` command: the run's own options from its plan, with this session's (``SESSION_
    OPTIONS``); an option that would change what the run measures is refused."""
    given = {k: v for k, v in vars(args).items() if k not in SESSION_OPTIONS and v != p.get_default(k)}
    changed = {k: v for k, v in given.items() if plan["options"].get(k) != v}
    if changed:
        p.error("--resume goes on with the run's own options; these differ from its plan: "
                + ", ".join(f"--{k.replace('_', '-')} {v} (the run's: {plan['options'].get(k)})"
                            for k, v in changed.items()))
    merged = {**plan["options"], **{k: getattr(args, k) for k in SESSION_OPTIONS}, "out": args.resume}
    return argparse.Namespace(**merged)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    folder = RunFolder(args.resume or args.out)
    plan = None
    if args.resume:
        try:
            plan = folder.plan()
        except RunFolderError as e:
            p.error(str(e))
        args = resumed_options(p, args, plan)
    methods = parse_methods(args.methods)
    unknown = sorted(m for m in set(methods) - set(ALL_METHODS) if not _sized(m))
    if unknown or args.per_category < 1 or args.max_new_tokens < 1 or args.rounds < 1:
        p.error(f"unknown methods {unknown}" if unknown else
                "--per-category, --max-new-tokens and --rounds must be >= 1")
    for name in ("fit_context", "shards", "workers", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.workers is not None and args.ray is None:
        p.error("--workers takes Ray workers: add --ray (without it one process runs the shards in turn)")
    if not args.resume:
        try:
            folder.check_new()  # before any worker starts
        except RunFolderError as e:
            p.error(str(e))
    try:
        samplings = [None if t is None else Sampling(t, seed=args.seed)
                     for t in parse_temperatures(args.temperatures)]
        questions = stratified(load_questions(args.questions), args.per_category)
    except ValueError as e:
        p.error(str(e))
    ids = [q.question_id for q in questions]
    by_category = [(q.question_id, q.category) for q in questions]
    if plan is None:
        plan = {"arguments": argv, "options": {k: v for k, v in vars(args).items() if k not in SESSION_OPTIONS},
                "questions": ids, "temperatures": [None if s is None else s.temperature for s in samplings],
                "shards": plan_shards(by_category, shard_count(args.shards, len(ids)))}
    elif plan["questions"] != ids:
        p.error(f"the questions of {args.questions or 'Spec-Bench'} are not the ones the run in {folder.path} "
                "started with")
    if args.report_so_far:
        if not args.resume:
            p.error("--report-so-far reports a run's folder: give it with --resume FOLDER")
        try:
            results, runners = assemble_results(folder, plan, args, samplings, questions)
        except RunFolderError as e:
            p.error(str(e))
        return write_report(folder.path, results, runners, args, "_so_far")
    if args.resume and plan["shards"] is not None and finished(folder, plan):
        print(f"every question of the run in {folder.path} is decoded already: its tables, written again")
        try:
            results, runners = assemble_results(folder, plan, args, samplings, questions)
        except RunFolderError as e:
            p.error(str(e))
        return write_report(folder.path, results, runners, args, "")
    started = time.perf_counter()  # the session's wall time counts the workers' setup (Ray's start, model, t(N))
    options = {**plan["options"], "exit_once": os.environ.get(EXIT_ONCE)}
    payload = [asdict(q) for q in questions]
    load_before = os.getloadavg()[0]
    try:
        if args.ray is None:
            pool = LocalPool(lambda name: BenchWorker(options, payload, name, args.threads))
        else:
            from .workers import RayPool  # Ray is optional: imported only for a run that asks for it
            # a worker on a GPU reserves one (Ray hides the GPUs from a worker that reserved none); auto: where the
            # cluster has GPUs
            gpus = 0 if args.device == "cpu" else 1 if args.device.startswith("cuda") else None
            pool = RayPool(BenchWorker, (options, payload), None if args.ray == "local" else args.ray,
                           args.workers, args.threads or 1, gpus)
    except ValueError as e:
        p.error(str(e))
    if plan["shards"] is None:
        plan["shards"] = plan_shards(by_category, len(pool.workers))
    try:
        if not args.resume:
            folder.start(plan)
        return _run(args, folder, plan, pool, samplings, questions, load_before, started)
    except ValueError as e:  # RunFolderError, or a restarted worker that could not set up again
        p.error(str(e))
    finally:
        pool.close()


SHARD_QUESTIONS = 24  # questions a shard holds where --shards is not given


def shard_count(shards: int | None, questions: int) -> int:
    """The shards a run's questions are dealt into: ``--shards``, else one per ``SHARD_QUESTIONS`` questions. Never
    the number of workers: each shard carries its own matrix through its questions, so a run's results depend on its
    shards, and they are fixed by the questions alone, whatever decodes them.

    >>> shard_count(None, 12), shard_count(None, 480), shard_count(3, 12)
    (1, 20, 3)
    """
    return shards or -(-questions // SHARD_QUESTIONS)


def finished(folder: RunFolder, plan: dict) -> bool:
    """Whether every shard of every temperature of the run in ``folder`` is decoded to its end."""
    return all(folder.state(t, s)[0] == len(shard) for t in range(len(plan["temperatures"]))
               for s, shard in enumerate(plan["shards"]))


def _run(args, folder: RunFolder, plan: dict, pool, samplings, questions, load_before: float, started: float) -> int:
    done = folder.done()
    units = []
    for t in range(len(plan["temperatures"])):
        for s, shard in enumerate(plan["shards"]):
            position, state = folder.state(t, s)
            if len(done.get((t, s), [])) != position:
                raise RunFolderError(f"{folder.path}: shard {s} has {len(done.get((t, s), []))} finished question(s) "
                                     f"but its state is at question {position}: questions.jsonl was cut")
            units.append(Unit(t, s, shard, position, state))
    total = sum(len(u.ids) for u in units)
    finished = sum(len(u.ids) - u.left for u in units)
    if load_before > 0.5:
        print(f"warning: load average {load_before:.1f} before the run: another process is using the CPU, and torch's "
              "threads slow down badly when they share cores; timings will be unreliable")
    where = "this process" if args.ray is None else f"Ray ({pool.address})"
    print(f"{total} question(s) in {len(plan['shards'])} shard(s) (drawn stratified by category), on "
          f"{len(pool.workers)} worker(s) in {where}" + (f"; resumed: {finished} done before" if finished else ""))
    bar = tqdm(total=total, initial=finished, desc="questions", unit="q")
    ran = []

    def on_line(line: dict, worker: str) -> None:
        if "worker_info" in line:
            folder.log(line["worker_info"])
            print_worker(line["worker_info"], args)
        ran.append(line["question_id"])
        bar.update(1)

    def log_session(decoded: float) -> float:
        wall = time.perf_counter() - started
        folder.log({"kind": "session", "wall_s": round(wall, 1), "workers": len(pool.workers), "questions": len(ran),
                    "setup_s": round(decoding - started, 1),  # Ray's start, the workers' model, t(N), warm-up
                    "decoding_s": round(decoded - decoding, 1),
                    "ray": None if args.ray is None else pool.address, "load_average_before": round(load_before, 2),
                    "load_average_after": round(os.getloadavg()[0], 2)})
        return wall

    def on_change(status: dict) -> None:
        per = " ".join(f"{w}:{n}" for w, n in sorted(status["done"].items()))
        bar.set_postfix_str(f"running {status['running']}, failed {status['failed']}" + (f"; {per}" if per else ""))

    decoding = time.perf_counter()
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, interrupted) if main_thread else None  # `kill` stops it as Ctrl-C does
    try:
        drive(pool, folder, units, on_line, on_change)
    except KeyboardInterrupt:
        bar.close()
        log_session(time.perf_counter())
        on_ray = "" if args.ray is None else " --ray" + ("" if args.ray == "local" else f" {args.ray}")
        print(f"\ninterrupted: {len(folder.lines())} of {total} question(s) are in {folder.path / 'questions.jsonl'};"
              f" go on with: python -m tr_core.tools.bench --resume {folder.path}{on_ray}")
        return 130
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)
    decoded = time.perf_counter()
    bar.close()
    for end in pool.finish():  # each worker's t(N) once more, for the drift
        folder.log(end)
    wall = log_session(decoded)
    results, runners = assemble_results(folder, plan, args, samplings, questions)
    config = results["config"]
    session = folder.logged("session")[-1]
    print(f"\nwall time {wall:.0f} s on {len(pool.workers)} worker(s): {len(ran)} question(s) in "
          f"{session['decoding_s']:.0f} s, after {session['setup_s']:.0f} s of setup; "
          f"{config['questions_per_worker_hour']:.1f} questions a worker-hour over the run's sessions "
          f"({config['wall_s']:.0f} s in all)")
    return write_report(folder.path, results, runners, args)


def write_report(out: Path, results: dict, runners, args, suffix: str = "") -> int:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results{suffix}.json").write_text(json.dumps(results, indent=1))
    text = report(results, runners, args)
    (out / f"report{suffix}.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {out / f'results{suffix}.json'}, {out / f'report{suffix}.md'}")
    return 0


def interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def print_worker(info: dict, args) -> None:
    """What a worker set itself up with, as the single-process benchmark always printed it."""
    print(f"{info['worker']} on {info['host']}: {info['machine']}, mode {info['mode_note']}; {info['backend_note']}; "
          f"torch threads {info['threads']}")
    print(f"hot start: {info['hot_start'] or 'none (no shipped matrix: cold start)'}, carried across each shard's "
          f"questions; {args.rounds} round(s) a question, each from the matrix held before the question")
    fitted = info["fitted_tree"]
    if fitted:
        print(f"fitted tree: {fitted['nodes']} nodes (depth {fitted['depth']}), predicted mean accepted tokens "
              f"{fitted['predicted_mean_accepted_tokens']:.2f}, predicted speedup {fitted['predicted_speedup']:.2f}x")
    weights = "" if not info["fit_context_weights"] else " (calibrated at " + ", ".join(
        f"{g} tokens x {w:.2f}" for g, w in info["fit_context_weights"].items()) + ")"
    print(f"t(N) ms over {info['fit_context']}{weights}: "
          + ", ".join(f"{n}:{t:.0f}" for n, t in info["t_n_ms"].items()))


class RecordsOf:
    """A method's records across the run (what ``report`` and ``temperature_summary`` read of a runner)."""

    def __init__(self, name: str, records: list[Record]):
        self.name, self.records = name, records


def assemble_results(folder: RunFolder, plan: dict, args, samplings, questions) -> tuple[dict, list[RecordsOf]]:
    """results.json from the run's folder: every finished question's records, in the run's question order (the
    same report however the run was split, stopped or resumed), with the workers' machines."""
    done = folder.done()
    lines = {t: {line["question_id"]: line for (tt, _), ls in done.items() if tt == t for line in ls}
             for t in range(len(plan["temperatures"]))}
    order = [qid for qid in plan["questions"] if all(qid in by_id for by_id in lines.values())]
    if not order:
        raise RunFolderError(f"{folder.path}: no question is finished yet (at every temperature)")
    questions = [q for q in questions if q.question_id in set(order)]
    workers = {w["worker_id"]: w for w in folder.logged("worker")}
    ends = {e["worker_id"]: e for e in folder.logged("worker_end")}
    sessions = folder.logged("session")
    first = lines[0][order[0]]
    names = list(first["records"])

    def runners_of(t: int) -> list[RecordsOf]:
        return [RecordsOf(n, [Record(**lines[t][qid]["records"][n]) for qid in order]) for n in names]

    runners = runners_of(0)
    by_temperature = {}
    for t, sampling in enumerate(samplings):
        if sampling is not None:
            by_temperature[f"{sampling.temperature:g}"] = {"sampling": sampling.describe(),
                                                           "methods": temperature_summary(runners_of(t))}
    main_worker = workers[first["worker_id"]]
    main_end = ends.get(first["worker_id"], {})
    count = Counter(lines[0][qid]["worker_id"] for qid in order)  # questions per worker (first temperature)
    machine_of = {qid: lines[0][qid]["machine"] for qid in order}
    machines = list(dict.fromkeys(machine_of.values()))

    plain_runner = next(r for r in runners if r.name == "plain")
    unpadded = next((r for r in runners if r.name == UNPADDED), None)
    if unpadded is not None and (statistics.median(x.tokens / x.seconds for x in unpadded.records)
                                 > statistics.median(x.tokens / x.seconds for x in plain_runner.records)):
        plain_runner = unpadded
    plain_tps = {r.question_id: r.tokens / r.seconds for r in plain_runner.records}
    categories = list(dict.fromkeys(q.category for q in questions))
    wall = sum(s["wall_s"] for s in sessions)
    worker_s = sum(s["wall_s"] * s["workers"] for s in sessions)
    curve = {int(k): v for k, v in main_worker["t_n_ms"].items()}
    curve_after = {int(k): v for k, v in main_end.get("t_n_ms_after_run", main_worker["t_n_ms"]).items()}
    results = {"methods": {}, "config": {
        "questions": len(order), "questions_planned": len(plan["questions"]), "per_category": args.per_category,
        "max_new_tokens": args.max_new_tokens,
        "mode": args.mode, "compiled": False, "dtype": main_worker["dtype"], "mode_note": main_worker["mode_note"],
        "model": args.model or "embedded", "hot_start": main_worker["hot_start"], "cpu": main_worker["cpu"],
        "device": main_worker["device"], "machine": main_worker["machine"], "backend": main_worker["backend"],
        "backend_note": main_worker["backend_note"], "rows": main_worker["rows"], "arguments": plan["arguments"],
        "sampling": (samplings[0] or Sampling()).describe(),
        "hot_start_carried_across_questions": True, "threads": main_worker["threads"],
        "t_n_ms": curve, "t_n_ms_after_run": curve_after,
        "t_n_ms_through_run": main_end.get("t_n_ms_through_run", curve),
        "t_n_calibrations_through_run": main_end.get("t_n_calibrations_through_run", 1),
        "fit_context": main_worker["fit_context"],
        "seconds": round(sum(s.get("decoding_s", s["wall_s"]) for s in sessions), 1),  # the questions' own time
        "load_average_before": sessions[0]["load_average_before"] if sessions else None,
        "load_average_after": sessions[-1]["load_average_after"] if sessions else None,
        "fitted_tree": main_worker["fitted_tree"], "lookahead_size": main_worker["lookahead_size"],
        "rounds": args.rounds, "round_order": names,
        "rounds_note": "each round runs every method once, in round_order rotated by one place a round (and on "
                       "across the questions of a shard); every round of a question starts Token Recycling from "
                       "the matrix held before the question, and the first round's matrix is carried on; a method's "
                       "time on a question is its median round (of an even count, the faster middle one)",
        "shards": {"count": len(plan["shards"]), "questions": plan["shards"],
                   "note": "questions dealt into shards stratified by category; each shard is decoded on one worker "
                           "at a time, in the order listed, the hot-start matrix carried from each question to the "
                           "next; every shard starts from the shipped hot start"},
        "workers": [{k: w[k] for k in ("worker_id", "worker", "host", "machine", "threads", "backend_note")}
                    | {"questions": count.get(w["worker_id"], 0),
                       "tree_nodes": (w["fitted_tree"] or {}).get("nodes")} for w in workers.values()],
        "question_machines": [{"question_id": qid, "shard": lines[0][qid]["shard"],
                               "position": lines[0][qid]["position"], "worker_id": lines[0][qid]["worker_id"],
                               "machine": machine_of[qid]} for qid in order],
        "machines": machines, "sessions": sessions, "wall_s": round(wall, 1),
        "questions_per_worker_hour": round(sum(s["questions"] for s in sessions) / (worker_s / 3600), 2)
        if worker_s else None,
        "speedup_definition": SPEEDUP_DEFINITION,
        "speed_baseline": plain_runner.name,
        "speed_baseline_note": None if unpadded is None else (
            f"plain decoding ran padded to {main_worker['rows']} rows a pass (the reference every method's tokens "
            f"are compared with) and unpadded ({UNPADDED}); the faster, {plain_runner.name}, is the speed baseline; "
            "their tokens " + ("agree on every question" if all(x.identical for x in unpadded.records) else
                               f"differ on {sum(not x.identical for x in unpadded.records)} question(s)")),
        "speedup_median_note": "speedup_median: the median over questions of a method's speedup (speedup_definition) "
                               "on each question; speedup_ci95: its percentile-bootstrap interval over questions; "
                               "verdict: faster / slower only where the interval excludes 1",
        "bootstrap": {**BOOTSTRAP, "min_questions_for_verdict": MIN_QUESTIONS_FOR_VERDICT},
    }}
    plain_token = summarize(plain_runner.records, plain_tps)["step_ms_per_token"]
    for r in runners:
        entry = summarize(r.records, plain_tps)
        entry.update(compare(ratios(r.records, plain_runner.records)))
        entry["by_category"] = {}
        for c in categories:
            mine = [x for x in r.records if x.category == c]
            if mine:
                entry["by_category"][c] = {**summarize(mine, plain_tps), **compare(ratios(mine, plain_runner.records))}
        if len(machines) > 1:
            entry["by_machine"] = {}
            for m in machines:
                mine = [x for x in r.records if machine_of[x.question_id] == m]
                entry["by_machine"][m] = {**summarize(mine, plain_tps), **compare(ratios(mine, plain_runner.records))}
        entry["accepted_length_histogram"] = dict(sorted(
            Counter(n for x in r.records for n in x.accepted_lengths).items()))
        entry["steps_speedup"] = round(plain_token / entry["step_ms_per_token"], 4)  # the steps' own, prefill left out
        entry["round_spread_pct"] = round_spread_pct(r.records)
        entry.update(tree_entry(r.name, workers, ends, count))
        entry["first_differences"] = [{"question_id": x.question_id, **x.first_difference}
                                      for x in r.records if x.first_difference]
        results["methods"][r.name] = entry
    for entry in results["methods"].values():
        if "predicted_speedup" in entry:
            entry.update(predicted_vs_measured(entry, results["methods"]["plain"]))
    results["pairwise"] = pairwise({r.name: r.records for r in runners}, categories)
    if by_temperature:
        results["temperatures"] = by_temperature
    return results, runners


def tree_entry(name: str, workers: dict, ends: dict, count: Counter) -> dict:
    """A Token Recycling runner's tree and, for a fitted one, its predictions: each worker fitted its own, so the
    predictions are averaged over the workers, weighted by the questions each ran; the nodes are the most common."""
    mine = [(w["trees"][name], count[wid], wid) for wid, w in workers.items() if name in w["trees"] and count[wid]]
    if not mine:
        return {}
    weight = sum(n for _, n, _ in mine)
    nodes = Counter(t["nodes"] for t, n, _ in mine for _ in range(n)).most_common(1)[0][0]
    out = {"tree_nodes": nodes}
    if len({t["nodes"] for t, _, _ in mine}) > 1:
        out["tree_nodes_by_worker"] = {wid: t["nodes"] for t, _, wid in mine}
    if "predicted_speedup" in mine[0][0]:
        def mean(f) -> float:
            return round(sum(f(t, wid) * n for t, n, wid in mine) / weight, 4)

        def through(t: dict, wid: str) -> float:
            curve = {int(k): v for k, v in workers[wid]["t_n_ms"].items()}
            later = {int(k): v for k, v in ends.get(wid, {}).get("t_n_ms_through_run", curve).items()}
            return speedup_on(t["predicted_speedup"], t["nodes"], curve, later)
        out["predicted_mean_accepted_tokens"] = mean(lambda t, _: t["predicted_mean_accepted_tokens"])
        out["predicted_speedup"] = mean(lambda t, _: t["predicted_speedup"])
        out["predicted_speedup_through_run"] = mean(through)
    return out


if __name__ == "__main__":
    raise SystemExit(main())

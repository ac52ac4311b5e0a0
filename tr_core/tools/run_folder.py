"""A benchmark run's folder (``--out``): what the run was asked, one line per finished question, and each shard's
carried state after its last finished question. A run stopped anywhere (a dead worker, a dead driver, Ctrl-C) goes
on with ``--resume FOLDER`` and gives the same report as a run that never stopped, timings aside.

    plan.json          the run's options, its temperatures and its shards (question ids, in the order decoded)
    questions.jsonl    one JSON line per finished (temperature, question): every method's record, plain decoding's
                       tokens, the shard and the question's place in it, and the worker and machine that ran it
    state/t{T}-s{S}.pkl    what unit (temperature T, shard S) carries to its next question: the matrices' changed rows
                       and what the runs learned besides (``bench.BenchWorker``), with that question's place
    log.jsonl          the workers (their machines, t(N), fitted trees) and each session's wall time
    results.json, report.md    once every question is done

A line is appended (and flushed to disk) before its unit's state is replaced, so a run that stops between the two
holds a line its state has not reached: it is decoded again on resume, and the later line of a place wins.

Shards are drawn stratified by category (``plan_shards``): every shard holds each category's share. Everything here is
plain data; the decoding is ``bench``'s, the workers ``workers``'.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Sequence

from ..cachefiles import write_atomically

PLAN, LINES, LOG, STATE = "plan.json", "questions.jsonl", "log.jsonl", "state"
RESULTS = ("results.json", "report.md")


class RunFolderError(ValueError):
    """A run folder that cannot be started or resumed as asked; the message says what to do."""


def plan_shards(questions: Sequence[tuple[int, str]], count: int) -> list[list[int]]:
    """``questions`` ((id, category), in the run's order) dealt into ``count`` shards (at most one per question),
    stratified: each category's questions go round the shards in turn, the turn going on from one category to the
    next so the shards' sizes differ by one at most; each shard keeps the run's order.

    >>> plan_shards([(1, "a"), (2, "b"), (3, "a"), (4, "b"), (5, "c")], 2)
    [[1, 2, 5], [3, 4]]
    """
    count = max(1, min(count, len(questions)))
    by_category: dict[str, list[int]] = defaultdict(list)
    for qid, category in questions:
        by_category[category].append(qid)
    owner, turn = {}, 0
    for ids in by_category.values():
        for qid in ids:
            owner[qid] = turn % count
            turn += 1
    shards: list[list[int]] = [[] for _ in range(count)]
    for qid, _ in questions:
        shards[owner[qid]].append(qid)
    return shards


def unit_name(temperature: int, shard: int) -> str:
    return f"t{temperature}-s{shard}"


class RunFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @property
    def started(self) -> bool:
        return (self.path / PLAN).is_file()

    def check_new(self) -> None:
        """Refuse a new run here where the folder holds an unfinished one (its questions would be lost); a finished
        run's files are replaced, as a run into the same ``--out`` always did."""
        if self.started and not (self.path / RESULTS[0]).is_file():
            raise RunFolderError(f"{self.path} holds an unfinished run ({len(self.lines())} question(s) done): go on "
                                 f"with --resume {self.path}, or choose another --out")

    def start(self, plan: dict) -> None:
        """Start a new run here (``check_new`` first)."""
        self.check_new()
        for name in (PLAN, LINES, LOG, *RESULTS):
            (self.path / name).unlink(missing_ok=True)
        if (self.path / STATE).is_dir():
            for f in (self.path / STATE).iterdir():
                f.unlink()
        self.path.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path / PLAN, json.dumps(plan, indent=1))

    def plan(self) -> dict:
        if not self.started:
            raise RunFolderError(f"{self.path} holds no benchmark run ({PLAN} is missing): nothing to resume")
        return json.loads((self.path / PLAN).read_text())

    def _append(self, name: str, entry: dict) -> None:
        path = self.path / name
        torn = False
        if path.is_file() and path.stat().st_size:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        with open(path, "a") as f:
            # a line cut short by a process that died mid-write is ended first, so it spoils no other line
            f.write(("\n" if torn else "") + json.dumps(entry, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def log(self, entry: dict) -> None:
        self._append(LOG, entry)

    def logged(self, kind: str | None = None) -> list[dict]:
        return [e for e in _read_lines(self.path / LOG) if kind is None or e.get("kind") == kind]

    def append(self, line: dict) -> None:
        """One finished question, flushed to disk."""
        self._append(LINES, line)

    def save_state(self, temperature: int, shard: int, position: int, state: bytes) -> None:
        """Unit (``temperature``, ``shard``)'s carried state once its questions before ``position`` are done."""
        write_atomically(self.path / STATE / f"{unit_name(temperature, shard)}.pkl",
                         position.to_bytes(4, "little") + state)

    def state(self, temperature: int, shard: int) -> tuple[int, bytes | None]:
        """The place of the unit's next question and the state it starts from (0, None: not started)."""
        path = self.path / STATE / f"{unit_name(temperature, shard)}.pkl"
        if not path.is_file():
            return 0, None
        data = path.read_bytes()
        return int.from_bytes(data[:4], "little"), data[4:]

    def lines(self) -> list[dict]:
        """Every line written (a last line cut short by a crash is left out)."""
        return _read_lines(self.path / LINES)

    def done(self) -> dict[tuple[int, int], list[dict]]:
        """Per unit (temperature, shard), its finished questions in shard order: the lines before the place its
        state has reached (a later line of the same place replaces an earlier one)."""
        by_place: dict[tuple[int, int, int], dict] = {}
        for line in self.lines():
            by_place[line["temperature_index"], line["shard"], line["position"]] = line
        out: dict[tuple[int, int], list[dict]] = defaultdict(list)
        reached = {}
        for (t, s, p), line in sorted(by_place.items()):
            if (t, s) not in reached:
                reached[t, s] = self.state(t, s)[0]
            if p < reached[t, s]:
                out[t, s].append(line)
        return dict(out)

    def missing_any(self) -> bool:
        plan = json.loads((self.path / PLAN).read_text())
        done = self.done()
        return any(len(done.get((t, s), [])) < len(ids) for t in range(len(plan["temperatures"]))
                   for s, ids in enumerate(plan["shards"]))


def _read_lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for text in path.read_text().splitlines():
        try:
            out.append(json.loads(text))
        except json.JSONDecodeError:  # a line cut short when the process died mid-write
            continue
    return out

"""One user's durable state (kept in ``gr.State``): the adjacency matrix their runs keep teaching, their latest live
run and race as finished records, and a summary of every run. Runs themselves live in ``ui.run``.

    session = Session()
    matrix, note = session.matrix_for(engine, "", hot_start=True)   # the shipped hot start, then what runs taught
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import zlib
from copy import deepcopy
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tr_core.assets import HOT_START_DIR, hot_start_files, model_slug
from tr_core.engine import Engine
from tr_core.events import TOKENS_PER_PASS, Rates, StepEvent
from tr_core.matrix import AdjacencyMatrix, MatrixDelta

from .records import Baseline, RaceRun


def starting_matrix(engine: Engine, hot_start: bool, folder: Path = HOT_START_DIR) -> tuple[AdjacencyMatrix, str]:
    """A new matrix for ``engine``'s model and k, and a line saying where it came from: the model's shipped hot-start
    matrix (one saved with a larger k gives its top ranks), else an empty matrix (cold start)."""
    vocab, k = engine.vocab_size, engine.config.top_k
    if not hot_start:
        return AdjacencyMatrix(vocab, k), "cold start: an empty matrix (hot start is off)"
    slug = model_slug(engine.model)
    files = hot_start_files(slug, k, folder)
    reasons = []
    for path in files:
        try:
            return AdjacencyMatrix.load(path, vocab, k), f"hot start from the shipped matrix {path.name}"
        except ValueError as e:
            reasons.append(str(e))
    if not files:
        return AdjacencyMatrix(vocab, k), f"cold start: no hot-start matrix is shipped for {slug} (assets/hot_start/)"
    return AdjacencyMatrix(vocab, k), f"cold start: no shipped matrix fits ({reasons[0]})"


# The starting matrix of each (model, k), loaded once per process and shared by every session, read-only: a session
# keeps only what its runs changed over it (``MatrixDelta``), a run drafts from a copy
_SHARED: dict[tuple, tuple[AdjacencyMatrix, str]] = {}
_SHARED_LOCK = threading.Lock()


def shared_start(engine: Engine, model_id: str) -> tuple[AdjacencyMatrix, str]:
    """``starting_matrix(engine, True)``, loaded once per (model, k) and shared: never change it, copy it."""
    key = (model_id, model_slug(engine.model), engine.vocab_size, engine.config.top_k)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = starting_matrix(engine, True)
        return _SHARED[key]


HISTORY_KEPT = 50  # the history table's lines a session keeps: its latest runs


def prompt_digest(prompt: str) -> str:
    """A short key for a prompt's text: the session counts runs per prompt without keeping every prompt."""
    return hashlib.sha1(prompt.encode("utf-8", "surrogatepass")).hexdigest()[:16]


@lru_cache(maxsize=8)
def _unpacked(packed: bytes) -> tuple[list[StepEvent], dict[int, str]]:
    # the few records read lately (a user dragging the step slider reads one many times), shared: read, never change
    return pickle.loads(zlib.decompress(packed))


@dataclass
class LiveRecord:
    """A finished (or stopped) live run: everything the step slider, the player and ``/trace`` show, with no model.
    ``events``: its step events; ``names``: the text of every token id they name. They fill as the run decodes
    (``steps``, ``token_names``); once it is over, ``pack`` keeps them compressed, and reading them unpacks them: a
    64-token run's events as Python objects took ~260 KB of a session's memory, most of it the matrix rows each step
    rewrote as lists of ints (tracemalloc)."""

    model_id: str
    mode: str
    tree: str
    steps: list[StepEvent]
    token_names: dict[int, str]
    hidden: tuple[str, ...] = ()  # the tokenizer's special tokens, not shown in the answer
    baseline: Baseline | None = None  # plain decoding's speed, measured beside the run
    summary: dict | None = None  # the finished run's figures (``ui.summaries.run_summary``)
    drafted_nothing: bool = False  # the auto tree stayed empty at every step: the run was plain decoding
    packed: bytes = b""  # ``steps`` and ``token_names``, compressed once the run is over

    @property
    def events(self) -> list[StepEvent]:
        """The run's step events, in order (once packed, a shared copy: read it, do not change it)."""
        return _unpacked(self.packed)[0] if self.packed else self.steps

    @property
    def names(self) -> dict[int, str]:
        return _unpacked(self.packed)[1] if self.packed else self.token_names

    def pack(self) -> None:
        """The run is over: keep its events and names compressed."""
        if not self.packed and self.steps:
            self.packed = zlib.compress(pickle.dumps((self.steps, self.token_names), pickle.HIGHEST_PROTOCOL), 1)
            self.steps, self.token_names = [], {}

    def token_text(self, token: int) -> str:
        return self.names.get(token, f"#{token}")


@dataclass
class RaceRecord:
    """A measured race: each method's run of every round (``rounds``, in round order) and its median round's run
    (``runs``, for the replay and ``/trace``)."""

    runs: dict[str, RaceRun]
    tree: str
    note: str  # what Token Recycling ran with: mode, tree, matrix
    rounds: dict[str, list[RaceRun]] = field(default_factory=dict)
    hidden: tuple[str, ...] = ()  # the tokenizer's special tokens, not shown in the lanes
    matrix_history: str = ""  # what the matrix every method started from had seen


@dataclass
class Session:
    """One user's state; it must deep-copy (``gr.State``)."""

    matrix_delta: MatrixDelta | None = None  # what this session's runs changed over the shared starting matrix
    matrix_base: AdjacencyMatrix | None = None  # that starting matrix, shared by every session (never changed)
    matrix_key: tuple[str, int] | None = None  # (model id, k) the matrix belongs to
    matrix_origin: str = ""
    runs_on_matrix: int = 0  # live runs that taught the matrix since it started
    prompt_runs: dict[str, int] = field(default_factory=dict)  # of those, how many per prompt (by digest)
    live: LiveRecord | None = None
    race: RaceRecord | None = None
    history: list[dict] = field(default_factory=list)
    narrow: bool = False  # the page is on a narrow screen (a phone): figures in their compact layout
    session_hash: str = ""  # gradio's id of the browser session, once a run has started (``app.Handlers``)
    model_id: str = ""  # the model this session last loaded or ran without a fault ("": the embedded one)

    def matrix_for(self, engine: Engine, model_id: str, hot_start: bool, prompt: str | None = None
                   ) -> tuple[AdjacencyMatrix, str]:
        """A working copy of the matrix a run on ``engine`` drafts from, and a line about it. With hot start, this
        session's matrix: the shared starting matrix (the shipped hot start) with what this session's runs taught
        it written over it; a run that teaches it hands it back with ``keep_matrix``. With ``prompt``, the line
        counts the earlier runs on it. Without hot start, an empty matrix. The copy is on the engine's device (its
        model's); the shared starting matrix and what the session keeps stay on the CPU."""
        device = engine.model.device
        if not hot_start:
            matrix, note = starting_matrix(engine, False)
            return matrix.to(device), note
        base, origin = shared_start(engine, model_id)
        key = (model_id, engine.config.top_k)
        if self.matrix_key != key:
            self.matrix_delta, self.matrix_origin = None, origin
            self.matrix_key, self.runs_on_matrix, self.prompt_runs = key, 0, {}
        self.matrix_base = base  # not copied with the session: see __deepcopy__
        taught = f", then taught by your {self.runs_on_matrix} earlier run{'s' * (self.runs_on_matrix != 1)}"
        if prompt is not None:
            taught += f", {self.prompt_runs.get(prompt_digest(prompt), 0)} of them on this prompt"
        matrix = self.matrix_delta.applied_to(base) if self.matrix_delta is not None else base.clone()
        return matrix.to(device), origin + (taught if self.runs_on_matrix else "")

    def keep_matrix(self, matrix: AdjacencyMatrix) -> None:
        """What a run taught: the session keeps the rows of ``matrix`` that differ from the starting matrix."""
        if self.matrix_base is not None:
            self.matrix_delta = matrix.delta_from(self.matrix_base)

    def __deepcopy__(self, memo):
        """gr.State copies the initial session for every user: the shared starting matrix is never copied."""
        copy = Session.__new__(Session)
        memo[id(self)] = copy
        for name, value in self.__dict__.items():
            setattr(copy, name, value if name == "matrix_base" else deepcopy(value, memo))
        return copy

    @property
    def state_bytes(self) -> int:
        """What this session holds, in bytes, as pickled (the shared starting matrix left out): its matrix's rows
        that differ from the shared one, its latest run and race, its history."""
        state = {k: v for k, v in self.__dict__.items() if k != "matrix_base"}
        return len(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))

    def matrix_start(self, hot_start: bool) -> str:
        """A short name for how a run's matrix starts, for the history table: ``"shipped + 2 runs"``, ``"cold"``."""
        if not hot_start:
            return "cold"
        shipped = "shipped" if self.matrix_origin.startswith("hot") else "empty"
        return f"{shipped} + {self.runs_on_matrix} runs" if self.runs_on_matrix else shipped

    def matrix_history(self, prompt: str, hot_start: bool) -> str:
        """What the session's matrix has seen before a run on ``prompt``: ``"the shipped hot start + 3 runs of yours,
        1 on this prompt"``."""
        if not hot_start:
            return "an empty matrix (hot start off): nothing seen before"
        start = "the shipped hot start" if self.matrix_origin.startswith("hot") else "an empty matrix"
        if not self.runs_on_matrix:
            return f"{start}, no run of yours yet"
        same = self.prompt_runs.get(prompt_digest(prompt), 0)
        return f"{start} + {self.runs_on_matrix} run{'s' * (self.runs_on_matrix != 1)} of yours, {same} on this prompt"

    def begin_live(self, model_id: str, mode: str, tree: str, hot_start: bool, hidden: tuple[str, ...] = (),
                   prompt: str = "") -> LiveRecord:
        """A live run starts: its record replaces the latest one and fills as it decodes; a run on the hot-started
        matrix counts as one that taught it (and on which prompt)."""
        self.live = LiveRecord(model_id, mode, tree, [], {}, hidden)
        if hot_start:
            self.runs_on_matrix += 1
            digest = prompt_digest(prompt)
            self.prompt_runs[digest] = self.prompt_runs.get(digest, 0) + 1
        return self.live

    def trace(self) -> dict:
        """The latest live run and race, every step event as plain data (as the command line's ``--trace`` writes
        them)."""
        live, race = self.live, self.race
        return dict(live=dict(tree=live.tree if live else "", model=(live.model_id if live else "") or "embedded",
                              events=[e.to_dict() for e in live.events] if live else []),
                    race=dict(tree=race.tree if race else "", rounds=len(race.rounds.get("plain", [])) if race else 0,
                              runs={m: [e.to_dict() for e in run.events] for m, run in race.runs.items()} if race
                              else {}))

    def record(self, what: str, tree: str, top_k: int | str, start: str, rates: Rates) -> None:
        """One line of the history table; the oldest lines go beyond ``HISTORY_KEPT`` (their runs are still
        numbered)."""
        number = self.history[-1]["run"] + 1 if self.history else 1
        del self.history[:max(0, len(self.history) + 1 - HISTORY_KEPT)]
        self.history.append({"run": number, "what": what, "tree": tree, "k": top_k,
                             "matrix at start": start, "tokens": rates.tokens, "decoding steps": rates.steps,
                             TOKENS_PER_PASS: f"{rates.mean_accepted_tokens:.2f}" if rates.steps else "-",
                             "tokens/s": f"{rates.tokens_per_s:.1f}"})

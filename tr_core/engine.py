"""A loaded model with its tokenizer, one decoding method and the Token Recycling matrix it keeps between requests.

    engine = Engine.load(None, EngineConfig(method="tr", tree="paper"))
    result = engine.generate("Tell me a story.", max_new_tokens=64)
    result = engine.generate("Tell me a story.", 64, sampling=Sampling(temperature=0.7, seed=3))  # sampled, exact
    for event in engine.stream("Another one.", 64): ...   # the matrix learned above is used here: hot start

On the "auto" tree (with the model's acceptance statistics) Token Recycling drafts with a tree budget
(``budget.TreeBudget``), started from the fitted tree's size and the calibrated t(N), which the engine keeps across
requests as it keeps the matrix: engines made by ``with_matrix``, and by ``with_config`` changing the method at most,
share it (they run the same settings on the same model and machine, so each run teaches it step times and node
acceptance by position in the tree; it holds no token); any other config starts a fresh one (``fresh_budget``).
Each method keeps its own budget (``budget_for``): the beyond-the-paper methods (``methods.py``) size their trees
with one too, and their nodes' acceptance means something else than the template's.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .assets import TREES_DIR, acceptance_path, acceptance_stats, hot_start_path, model_slug
from .backend import (
    BACKENDS,
    DEFAULT_FIT_CONTEXT,
    MODES,
    interpolate,
    load_dtype,
    make_backend,
    mode_note,
    pass_rows,
    prepare,
    resolve_backend,
    resolve_device,
    step_curve,
)
from .beyond.context import BranchAcceptance, ContextRecyclingDrafter, PlusRecyclingDrafter
from .beyond.dynamic import DynamicRecyclingDrafter, PathCalibration
from .beyond.suffix import SuffixDrafter
from .budget import TreeBudget, candidate_sizes, likeliest_first
from .decoding import DecodeResult, decode, max_positions, run
from .drafters import (
    AdaptiveRecyclingDrafter,
    Drafter,
    NestedTrees,
    PlainDrafter,
    PromptLookupDrafter,
    RecyclingDrafter,
    nested_trees,
)
from .events import StepEvent
from .fitting import FittedTree, auto_tree, has_acceptance_stats
from .matrix import AdjacencyMatrix
from .methods import METHODS as METHOD_SPECS
from .methods import NAMES
from .methods import check as check_method
from .models import encode_prompt, eos_token_ids, load_model
from .rivals.lookahead import LookaheadDrafter, choose_size
from .rivals.rest import RestDrafter, python_sources_datastore
from .sampling import Sampling
from .text import TokenText
from .tree import TreeBuffers, load_template

TREE_DIRS = (TREES_DIR,)  # where a tree named by the user is looked up, beside the built-in templates
METHODS = NAMES
AUTO = "auto"
FALLBACK_TREE = "small"


@dataclass(frozen=True)
class EngineConfig:
    method: str = "tr"
    tree: str = "auto"  # Token Recycling: "auto" (the N likeliest nodes, N adapted online from the fitted size),
    #                     "auto-N" (the N likeliest nodes, fixed), a template name or a .json file
    top_k: int = 8  # Token Recycling: candidates per matrix row
    matrix_path: str | None = None  # Token Recycling: hot-start file; None = cold start
    seed_from_prompt: bool = True  # Token Recycling: fill rows from the prompt's prefill logits
    fit_context: int | tuple[int, ...] = DEFAULT_FIT_CONTEXT  # "auto" trees: the context length (tokens) t(N) is
    #                     calibrated on, or several, to fit on t(N) averaged over them (calibrate.context_curve)
    mode: str = "exact"  # "exact" (fp32) or "fast" (fp16 weights on x86 CPUs, else bf16); see kernels.py
    pld_max_ngram: int = 3
    pld_max_draft: int = 10
    device: str = "auto"  # where ``Engine.load`` puts the model: "auto" (CUDA where torch sees it), "cpu", "cuda:N"
    backend: str = "auto"  # "native" (this project's CPU kernels), "torch" (fixed shapes, any device), "auto":
    #                        native on a CPU, torch elsewhere (tr_core/backend.py)
    rows: int | None = None  # the torch backend: query rows of every pass (None: the tree's size, rounded up)

    def __post_init__(self):
        check_method(self.method)
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.rows is not None and not 1 <= self.rows <= 1024:
            raise ValueError(f"rows must be between 1 and 1024, got {self.rows}")
        if not 1 <= self.top_k <= 64:
            raise ValueError(f"top_k must be between 1 and 64, got {self.top_k}")
        contexts = (self.fit_context,) if isinstance(self.fit_context, int) else self.fit_context
        if not isinstance(contexts, tuple) or not contexts or not all(isinstance(c, int) and c >= 1 for c in contexts):
            raise ValueError(f"fit_context must be a token count >= 1, or a non-empty tuple of them; "
                             f"got {self.fit_context!r}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.tree != AUTO and not self.tree.startswith(AUTO + "-"):
            check_ranks(load_template(self.tree, TREE_DIRS), self.top_k)


def check_ranks(tree: TreeBuffers, top_k: int) -> None:
    if tree.max_rank >= top_k:
        raise ValueError(f"tree {tree.name!r} uses rank {tree.max_rank}, which needs top_k >= "
                         f"{tree.max_rank + 1}; top_k is {top_k}")


def _nested_for(model: PreTrainedModel, fitted: FittedTree, cap: int | None = None) -> NestedTrees:
    """The trees an "auto" budget chooses among: the candidate sizes (with the fitted size) of the shipped
    statistics' nodes, likeliest first, as ``fit_tree`` orders them; none larger than the fitted table goes, nor
    than ``cap`` (the rows of a torch-backend pass)."""
    stats = json.loads(acceptance_path(model_slug(model)).read_text())
    order = likeliest_first(stats["acceptance"])
    paths = [tuple(stats["node_paths"][i]) for i in order[1:]]
    limit = min(len(fitted.table), cap or len(order))
    sizes = [n for n in candidate_sizes(len(order), include=[fitted.tree.size]) if n <= limit]
    return nested_trees(paths, sizes)


def _resolve_tree(model: PreTrainedModel, config: EngineConfig,
                  curve: dict[int, float] | None = None) -> tuple[FittedTree | None, TreeBuffers]:
    """The tree a config asks for. "auto" needs the model's shipped acceptance statistics; a model without them
    (any other hub model) falls back to the "small" template. ``curve``: the backend's own t(N), where it is not
    the native one's."""
    fitted = None
    sized = config.tree.startswith(AUTO + "-") and config.tree[len(AUTO) + 1:].isdigit()
    if (config.tree == AUTO or sized) and has_acceptance_stats(model):
        fitted = auto_tree(model, size=int(config.tree[len(AUTO) + 1:]) if sized else None,
                           context=config.fit_context, curve=curve)
    elif sized:
        raise ValueError(f"tree {config.tree!r} needs acceptance statistics for this model "
                         "(python -m tr_core.tools.build_assets)")
    name = FALLBACK_TREE if config.tree == AUTO else config.tree
    tree = fitted.tree if fitted else load_template(name, TREE_DIRS)
    check_ranks(tree, config.top_k)
    return fitted, tree


@dataclass
class Learners:
    """What an engine's runs learn besides the matrix, kept across requests by every engine of one setting
    (``with_matrix``, ``with_config`` changing the method at most): per method, its tree budget (step times and node
    acceptance), how often its context branches were accepted by match length (``tr-context``, ``tr-plus``) and how
    many drafts a unit of path probability brought (``tr-dynamic``, ``tr-plus``). None of it holds a token."""

    budgets: dict[str, TreeBudget] = field(default_factory=dict)
    branches: dict[str, BranchAcceptance] = field(default_factory=dict)
    calibrations: dict[str, PathCalibration] = field(default_factory=dict)


class Engine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 config: EngineConfig = EngineConfig(), like: "Engine | None" = None):
        """An engine over a loaded ``model``: its kernels prepared for ``config.mode``, its tree fitted, a fresh
        matrix. ``like``: an engine on the same model whose measured parts this one takes where ``config`` allows
        (the output layer, the REST datastore, the torch backend's rows and the fitted tree where their settings are
        the same, the learners where only the method differs): what ``with_config`` passes."""
        if like is not None:
            if like.model is not model:
                raise ValueError("like: an engine on the same loaded model")
            if config.mode != like.config.mode:
                raise ValueError("the mode sets the model's dtype: load another engine to change it")
        self._datastore = like._datastore if like else None  # REST's, on first use (``datastore``)
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.backend_name = resolve_backend(config.backend, model.device)
        if like is not None and self.backend_name != like.backend_name:
            raise ValueError("the backend sets the model's kernels: load another engine to change it")
        # the kernels for the mode (the native backend's measured here, tr_core/speed/kernels.py) and the output layer
        self.head = like.head if like else prepare(model, self.backend_name, config.mode)
        self.config = config
        same_rows = like is not None and (config.rows, config.fit_context) == (like.config.rows,
                                                                                like.config.fit_context)
        self.rows = like.rows if same_rows else self._rows()
        if like is not None and (config.tree, config.top_k, config.fit_context) == (
                like.config.tree, like.config.top_k, like.config.fit_context):
            self.fitted, self.tree, self.nested = like.fitted, like.tree, like.nested  # no need to fit again
        else:
            self.fitted, self.tree = _resolve_tree(model, config, self._torch_curve())
            self.nested = _nested_for(model, self.fitted, self.rows) if self.adaptive else None
        reuse = like is not None and self.rows == like.rows and config.rows == like.config.rows
        self.backend = like.backend if reuse else self._make_backend()
        # the same settings share the budgets: each run teaches its method's (see the module docstring)
        same = like is not None and replace(config, method=like.config.method) == like.config
        self.learners = like.learners if same else Learners()
        self.matrix = self.fresh_matrix()
        self._variants: dict[str, Engine] = {}  # the registry's variants of a method (drafter), made on first use

    def _torch_curve(self) -> dict[int, float] | None:
        """The torch backend's t(N), measured on its device (``fixed.timing.rows_curve``); None on the native one,
        whose t(N) the fitting reads itself (``calibrate.context_curve``)."""
        return step_curve(self.model, "torch", self.config.fit_context) if self.backend_name == "torch" else None

    def mode_note(self) -> str:
        """The mode in words: what the native kernels chose for it here, or the torch backend's dtype."""
        if self.backend_name == "native":
            return mode_note(self.config.mode, self.model)
        return f"{self.config.mode}: {str(self.model.dtype).removeprefix('torch.')} (torch backend)"

    def step_curve(self) -> dict[int, float]:
        """t(N) (ms) of this engine's backend on this machine, on the config's ``fit_context``."""
        return step_curve(self.model, self.backend_name, self.config.fit_context)

    def _rows(self) -> int | None:
        """The torch backend's query rows a pass, the same for every engine of one model and ``fit_context``, so
        that plain decoding and every method run the same shapes (a larger draft is cut to them): the config's, else
        the size of the tree the chooser fits on the backend's own t(N) (``fit_tree`` over ``fixed.timing``'s
        curve, where a step of N nodes costs a pass of N rows rounded up to ``fixed.TILE``), rounded up; for a model
        without acceptance statistics ``fixed.default_rows``. None on the native backend, whose passes take the
        draft's own rows."""
        if self.backend_name != "torch":
            return None
        if self.config.rows:
            return self.config.rows
        if not has_acceptance_stats(self.model):
            return pass_rows(self.model, None)
        fitted = auto_tree(self.model, context=self.config.fit_context, curve=self._torch_curve())
        return pass_rows(self.model, fitted.tree.size)

    def _make_backend(self):
        return make_backend(self.model, self.backend_name, self.rows, head=self.head)

    @classmethod
    def load(cls, model_id: str | None = None, config: EngineConfig = EngineConfig(),
             dtype: torch.dtype | None = None) -> "Engine":
        device = resolve_device(config.device)
        if dtype is None:
            dtype = load_dtype(resolve_backend(config.backend, device), config.mode)
        model, tokenizer = load_model(model_id, dtype=dtype, device=str(device))
        return cls(model, tokenizer, config)

    @property
    def context_length(self) -> int | None:
        """The most positions the model takes, prompt and answer together (``None`` if its config does not say)."""
        return max_positions(self.model)

    @property
    def adaptive(self) -> bool:
        """Whether Token Recycling's tree size adapts online: the "auto" tree of a model with acceptance
        statistics."""
        return self.config.tree == AUTO and self.fitted is not None

    @property
    def budget(self) -> TreeBudget | None:
        """Token Recycling's (``tr``) tree budget; None where the tree does not adapt."""
        return self.budget_for("tr")

    def budget_for(self, method: str) -> TreeBudget | None:
        """The tree budget ``method`` drafts with on this engine's settings, shared by every engine that shares
        this one's budgets (``with_matrix``, ``with_config`` changing the method at most); None where the tree does
        not adapt."""
        if not self.adaptive:
            return None
        budgets = self.learners.budgets
        if method not in budgets:
            budgets[method] = self.fresh_budget()
        return budgets[method]

    def fresh_budget(self) -> TreeBudget | None:
        """A tree budget started from the fitted tree's size, the calibrated t(N) and the shipped acceptance (in
        the fitted table's likeliest-first order); None where the tree does not adapt."""
        if not self.adaptive:
            return None
        table = self.fitted.table  # row n - 1: the n likeliest nodes
        expected = [row["expected_accepted"] for row in table]
        acceptance = [1.0] + [max(0.0, b - a) for a, b in zip(expected, expected[1:])]
        sizes = self.nested.sizes
        # the fitted size, or the largest size under it where the torch backend's rows cap the trees (``_nested_for``)
        start = max(n for n in sizes if n <= self.fitted.tree.size)
        return TreeBudget(sizes, [table[n - 1]["step_ms"] for n in sizes], acceptance, start=start)

    def fresh_matrix(self) -> AdjacencyMatrix:
        """The starting matrix: the hot-start file if the config names one, else an empty (cold) matrix."""
        device = self.model.device
        if self.config.matrix_path:
            return AdjacencyMatrix.load(self.config.matrix_path, self.vocab_size, self.config.top_k, device)
        return AdjacencyMatrix(self.vocab_size, self.config.top_k, device)

    def shipped_matrix_path(self) -> str | None:
        """The hot-start matrix shipped for this model and k (``python -m tr_core.tools.build_assets``), if there is
        one."""
        path = hot_start_path(model_slug(self.model), self.config.top_k)
        return str(path) if path.is_file() else None

    def with_config(self, **changes) -> "Engine":
        """Another engine on the same loaded model with some settings changed (and its own matrix; the same tree
        budgets where only the method changed, else fresh ones): ``Engine(..., like=self)``. The mode is the loaded
        model's dtype and the backend its kernels: changing either needs a new ``Engine.load``."""
        return Engine(self.model, self.tokenizer, replace(self.config, **changes), like=self)

    def with_matrix(self, matrix: AdjacencyMatrix) -> "Engine":
        """Another engine on the same model and settings that drafts from (and teaches) ``matrix``: a user's own
        matrix, or a copy of it for a measurement. It shares this engine's tree budget (``copy.copy``): a run
        teaches the budget of the settings it ran."""
        if (matrix.vocab_size, matrix.k) != (self.vocab_size, self.config.top_k):
            raise ValueError(f"a matrix of {matrix.vocab_size} x {matrix.k} does not fit this engine's "
                             f"{self.vocab_size} x {self.config.top_k}")
        if not matrix.is_on(self.model.device):  # drafting and learning must not cross devices
            raise ValueError(f"the matrix is on {matrix.device}, the model on {self.model.device}: pass "
                             f"matrix.to({str(self.model.device)!r}) (and keep that one: it is what the runs teach)")
        engine = copy.copy(self)
        engine.matrix = matrix
        return engine

    def datastore(self):
        """REST's datastore for this engine's tokenizer (``rivals.rest.python_sources_datastore``: built on first
        use, then cached on disk and shared by the process), unless one was given (``use_datastore``)."""
        if self._datastore is None:
            self._datastore = python_sources_datastore(self.tokenizer)
        return self._datastore

    def use_datastore(self, store) -> None:
        """Draft REST from ``store`` (a ``rivals.rest.Datastore`` in this model's vocabulary)."""
        self._datastore = store

    def drafter(self, method: str | None = None) -> Drafter:
        """The drafter of ``method`` (``methods.METHODS``; None: the config's) on this engine's matrix, tree and
        budgets; a variant of another method's drafter (``tr-paper``, ``tr-cold``) on its own settings, from the
        registry (``Method.settings``)."""
        method = check_method(method or self.config.method)
        spec = METHOD_SPECS[method]
        if spec.drafts != method:  # made once per engine, so that its tree budget learns across its runs
            if method not in self._variants:
                self._variants[method] = self.with_config(**spec.settings())
            variant = self._variants[method]
            return (variant.with_matrix(variant.fresh_matrix()) if spec.cold_start
                    else variant.with_matrix(self.matrix)).drafter(spec.drafts)
        seed = self.config.seed_from_prompt
        if method == "plain":
            return PlainDrafter()
        if method == "pld":
            return PromptLookupDrafter(self.config.pld_max_ngram, 1, self.config.pld_max_draft)
        if method == "suffix":
            return SuffixDrafter()
        if method == "rest":  # as many of the likeliest nodes as pay for themselves on this machine's t(N)
            curve = self.step_curve()
            calibration = self.learners.calibrations.setdefault(method, PathCalibration())  # kept across requests
            return RestDrafter(self.datastore(), step_ms=lambda n: interpolate(curve, n), calibration=calibration)
        if method == "lookahead":
            size = self.lookahead_size()
            return LookaheadDrafter(size["width"], size["n"], size["guesses"])
        if method == "tr":
            budget = self.budget_for(method)
            if budget is None:
                return RecyclingDrafter(self.matrix, self.tree, seed)
            return AdaptiveRecyclingDrafter(self.matrix, self.nested, budget, seed)
        nested, budget = self._sizing(method)
        return self._beyond_paper(method, nested, budget, seed)

    def lookahead_size(self) -> dict:
        """Lookahead decoding's window size, n-gram size and guesses (``width``, ``n``, ``guesses``) for this model
        on this machine, and ``why``: of the sizes measured for the model (shipped with its acceptance statistics),
        the one with the most tokens per ms on t(N) measured here (``rivals.lookahead.choose_size``)."""
        measured = (acceptance_stats(self.model) or {}).get("lookahead", [])
        curve = self.step_curve() if measured else None
        return choose_size(measured, (lambda n: interpolate(curve, n)) if curve else None)

    def _sizing(self, method: str) -> tuple[NestedTrees, TreeBudget]:
        """The trees and the budget a method beyond the paper sizes its drafts with: the "auto" tree's, or, on
        another tree (or a model without acceptance statistics), that tree or the root alone, on the t(N) measured
        for this model (``calibrate.context_curve``), the tree's nodes in BFS order standing for likeliest first."""
        if self.adaptive:
            return self.nested, self.budget_for(method)
        sizes = sorted({1, self.tree.size})
        nested = nested_trees(list(self.tree.node_paths[1:]), sizes, name=self.tree.name)
        budgets = self.learners.budgets
        if method not in budgets:
            curve = self.step_curve()
            prior = [0.5 ** len(p) for p in self.tree.node_paths]  # the root's 1.0, then halving with depth
            budgets[method] = TreeBudget(sizes, [interpolate(curve, n) for n in sizes], prior)
        return nested, budgets[method]

    def _beyond_paper(self, method: str, nested: NestedTrees, budget: TreeBudget, seed: bool) -> Drafter:
        # what the method learns besides step times, kept across requests like the budget
        learners = self.learners
        if method in ("tr-context", "tr-plus"):
            branch = learners.branches.setdefault(method, BranchAcceptance())
        if method in ("tr-dynamic", "tr-plus"):
            calibration = learners.calibrations.setdefault(method, PathCalibration())
        if method == "tr-context":
            return ContextRecyclingDrafter(self.matrix, nested, budget, seed, branch=branch)
        if method == "tr-dynamic":
            return DynamicRecyclingDrafter(self.matrix, budget=budget, seed_from_prompt=seed, calibration=calibration)
        return PlusRecyclingDrafter(self.matrix, nested, budget, seed, calibration=calibration, branch=branch)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, use_chat_template=None if chat else False)

    def stream(self, prompt: str | list[int], max_new_tokens: int, method: str | None = None,
               chat: bool = True, sampling: Sampling | None = None) -> Iterator[StepEvent]:
        """One event per forward pass. ``sampling``: how tokens are chosen (None: greedy); with the same
        ``Sampling``, every method's output equals plain decoding's."""
        ids = prompt if isinstance(prompt, list) else self.encode(prompt, chat)
        return decode(self.model, ids, self.drafter(method), max_new_tokens, self.eos_ids, TokenText(self.tokenizer),
                      self.head, sampling, self.backend)

    def generate(self, prompt: str | list[int], max_new_tokens: int, method: str | None = None,
                 chat: bool = True, sampling: Sampling | None = None) -> DecodeResult:
        ids = prompt if isinstance(prompt, list) else self.encode(prompt, chat)
        return run(self.model, ids, self.drafter(method), max_new_tokens, self.eos_ids, TokenText(self.tokenizer),
                   head=self.head, sampling=sampling, backend=self.backend)

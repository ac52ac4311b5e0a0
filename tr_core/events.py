"""Plain-data step events: one per verification forward pass.

The decoder yields these; the UI, the benchmark, saved traces and the tests all read the same stream. Every field
is an int, float, str, bool, or a list/dict of those, so ``json.dumps(event.to_dict())`` always works and
``StepEvent.from_dict`` restores an equal event.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

# The key number, one name everywhere (the app, the walkthrough, the benchmark's report): new tokens per verification
# forward pass, the bonus token counted (so a step that accepted no draft still counts 1)
TOKENS_PER_PASS = "tokens per forward pass (bonus token included)"


@dataclass(frozen=True)
class Rates:
    """The two rates every run reports, from its counts: mean accepted tokens (tokens per forward pass, the bonus
    token counted) and tokens per second.

    >>> r = Rates(tokens=10, steps=4, seconds=2.0)
    >>> r.mean_accepted_tokens, r.tokens_per_s
    (2.5, 5.0)
    >>> Rates().tokens_per_s
    0.0
    """

    tokens: int = 0
    steps: int = 0
    seconds: float = 0.0

    @property
    def mean_accepted_tokens(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class RowUpdate:
    """One adjacency-matrix row overwritten after a step: ``token``'s candidates went from ``old`` to ``new``."""

    token: int
    old: list[int]
    new: list[int]


@dataclass
class StepEvent:
    """What happened in one decoding step (one forward pass of the target model).

    The draft tree is given node by node in BFS order, node 0 being the root (the last token, not yet in the
    KV cache). ``predicted[i]`` is the model's next token after node ``i``: its greedy choice, or in a sampled step
    the sampled one (``sampling.py``). The accepted path lists node
    indices from the root; the new tokens are the accepted draft tokens followed by the bonus token, cut at EOS or
    at the ``max_new_tokens`` budget.

    With a tree budget (``tr`` on the ``auto`` tree), ``budget`` is the number of draft nodes (root not counted)
    chosen for this step, and ``budget_estimates`` what it was chosen from (``budget.TreeBudget.estimates``):
    ``{"sizes": [draft nodes, ...], "step_ms": [...], "expected_tokens": [per step, bonus included], "tokens_per_s":
    [...], "best": draft nodes with the most expected tokens/s, "explored": bool (this step tries a neighbour of
    "best" instead), "speed": the machine-speed factor against the calibration}``. Without one: None and {}.

    ``sampling`` says how the step chose: "greedy", or e.g. "sampled: T=0.7, top-p 0.9, top-k 50, seed 3"
    (``Sampling.describe``). In a sampled step ``draft_probs[i]`` is node ``i``'s probability under its parent's
    processed distribution (temperature, top-k and top-p applied; the root: 1.0); in a greedy step it is empty.
    """

    step: int
    method: str
    tree_name: str
    tree_tokens: list[int]
    tree_parents: list[int]
    tree_ranks: list[int]
    tree_text: list[str]
    predicted: list[int]
    accepted_path: list[int]
    bonus_token: int
    new_tokens: list[int]
    new_text: str
    rows_updated: list[RowUpdate] = field(default_factory=list)
    forward_ms: float = 0.0  # the verifier's work: forward pass, output layer and the choice over the vocabulary
    overhead_ms: float = 0.0  # the rest of the step: drafting, acceptance, the matrix and cache updates, the event
    budget: int | None = None
    budget_estimates: dict = field(default_factory=dict)
    # where each node's token came from (root included): empty = the matrix by a template (or, for plain and pld,
    # the context); else e.g. "root", "matrix", "best-first", "context" (TreeBuffers.sources)
    tree_sources: list[str] = field(default_factory=list)
    sampling: str = "greedy"
    draft_probs: list[float] = field(default_factory=list)
    # running counters, after this step
    total_tokens: int = 0
    total_steps: int = 0
    elapsed_s: float = 0.0
    finished: bool = False
    stop_reason: str | None = None  # "eos", "max_new_tokens" or "context_full" on the last event

    @property
    def accepted_draft_tokens(self) -> int:
        """Draft tokens the model agreed with (the root and the bonus token not counted)."""
        return len(self.accepted_path) - 1

    @property
    def rates(self) -> Rates:
        """The run's rates so far: tokens per forward pass (bonus token counted) and tokens per second."""
        return Rates(self.total_tokens, self.total_steps, self.elapsed_s)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StepEvent":
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["rows_updated"] = [RowUpdate(**r) for r in data.get("rows_updated", [])]
        return cls(**kwargs)


def token_ids_named(events: list[StepEvent]) -> list[int]:
    """Every token id a run's events name, sorted: tree tokens, predictions, new and bonus tokens, and the old and
    new candidates of every rewritten matrix row (what a figure of any step may have to label)."""
    ids: set[int] = set()
    for e in events:
        ids.update(e.tree_tokens, e.predicted, e.new_tokens, [e.bonus_token])
        for row in e.rows_updated:
            ids.update(row.old, row.new, [row.token])
    return sorted(ids)

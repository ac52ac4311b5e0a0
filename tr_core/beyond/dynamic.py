"""Token Recycling with a dynamic draft tree ("tr-dynamic"): grown best-first from the adjacency matrix's
probabilities each step, instead of retrieved by a static template.

The matrix keeps, beside each row's k ids, their probabilities (``AdjacencyMatrix.probs``). A draft node's
estimated probability is the product of the probabilities along its path from the root: the child of node ``i`` at
rank ``r`` gets ``p_i * probs[token_i, r]`` (the root has 1). ``grow_best_first`` pops the likeliest candidate from a
heap, adds it to the tree and pushes its k children, until the node budget is spent. A child is never likelier than
its parent, so nodes come out with non-increasing path probability and every prefix of that order is a tree: the
``N`` nodes drafted are the ``N`` likeliest reachable ones.

Rows never written have probability 0: their children are never drafted, so a cold matrix drafts a smaller tree
(the root alone at first). Rows whose probabilities are unknown read as the matrix's prior (``AdjacencyMatrix.prior``).

How many nodes: with a tree budget, each step's own path probabilities decide. The sum of the drafted nodes' path
probabilities is the step's expected accepted drafts (times a calibration learned from what was accepted:
``PathCalibration``; the matrix's probabilities are from earlier contexts), and the budget's running step-time
estimates say what each size costs; the step drafts the size with the most expected tokens per ms
(``choose_size``). A step after a confident token drafts a deep tree; one after an uncertain token, none.
"""

from __future__ import annotations

import heapq

import torch

from ..budget import TreeBudget, step_time
from ..drafters import Draft, Outcome, RecyclingDrafter
from ..events import RowUpdate
from ..matrix import AdjacencyMatrix
from ..tree import chain_tree, tree_from_parents


def grow_best_first(matrix: AdjacencyMatrix, root: int,
                    max_nodes: int) -> tuple[list[int], list[int], list[int], list[float]]:
    """The ``max_nodes`` likeliest draft nodes after ``root`` (fewer where fewer have a probability above 0), in
    best-first order, the root first and extra: ``(tokens, parents, ranks, path_probs)``, one entry per node;
    ``parents[i]`` indexes these lists (-1 for the root), ``ranks[i]`` is the node's rank in its parent's row,
    ``path_probs[i]`` the product of the probabilities along its path. Equal probabilities pop in push order.

    >>> m = AdjacencyMatrix(8, k=2, keep_probs=True)
    >>> probs = torch.tensor([[0.5, 0.25], [0.75, 0.125]])
    >>> _ = m.update(torch.tensor([1, 2]), torch.tensor([[2, 3], [4, 5]]), probs=probs)
    >>> grow_best_first(m, 1, 3)  # 1 -> 2 (0.5), 1 -> 2 -> 4 (0.5 * 0.75), 1 -> 3 (0.25); 3's row is empty
    ([1, 2, 4, 3], [-1, 0, 1, 0], [0, 0, 0, 1], [1.0, 0.5, 0.375, 0.25])
    """
    rows, probs = matrix.rows, matrix.probs
    if rows.device.type == "cpu":  # views: one row's tolist() costs ~1 us, ~5 us from a tensor
        rows, probs = rows.numpy(), None if probs is None else probs.numpy()
    tokens, parents, ranks, path_probs = [root], [-1], [0], [1.0]
    heap: list[tuple[float, int, int, int, int]] = []  # (-path probability, push order, parent, rank, token)
    prior = None
    pushed = 0
    while True:
        i = len(tokens) - 1  # push the children of the node added last (the root first), unless the budget is spent
        if i >= max_nodes:
            return tokens, parents, ranks, path_probs
        row_t = rows[tokens[i]].tolist()
        # a matrix that keeps no probabilities reads as one where they are unknown (written rows) or 0 (never written)
        row_p = probs[tokens[i]].tolist() if probs is not None else [float("nan") if any(row_t) else 0.0] * len(row_t)
        if row_p[0] != row_p[0]:  # NaN: probabilities unknown
            prior = prior or matrix.prior()
            row_p = prior
        p = path_probs[i]
        for r, q in enumerate(row_p):
            if q > 0:
                heapq.heappush(heap, (-p * q, pushed, i, r, row_t[r]))
                pushed += 1
        if not heap:
            return tokens, parents, ranks, path_probs
        neg, _, parent, rank, token = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        ranks.append(rank)
        path_probs.append(-neg)


class PathCalibration:
    """How many drafts were accepted per unit of estimated path probability: a running ratio (each sum decays by
    ``keep`` a step), started at 1. The matrix's probabilities were written in earlier contexts, so they are
    neither exact nor unbiased for this one. Each step also adds ``1 - keep`` to both sums (a prior of weight 1 in
    the steady state), so steps that draft nothing (nothing predicted, nothing accepted) pull the factor back
    towards 1 and drafting resumes, instead of the factor freezing where it stopped it.

    >>> c = PathCalibration(keep=0.5)
    >>> c.observe(predicted=2.0, accepted=1); round(c.factor, 3)  # (0.5 + 1 + 0.5) / (0.5 + 2 + 0.5)
    0.667
    >>> for _ in range(20): c.observe(0.0, 0)
    >>> round(c.factor, 3)
    1.0
    """

    def __init__(self, keep: float = 0.97):
        self.keep, self.predicted, self.accepted = keep, 1.0, 1.0

    @property
    def factor(self) -> float:
        return self.accepted / self.predicted

    def observe(self, predicted: float, accepted: int) -> None:
        self.predicted = self.keep * self.predicted + predicted + (1 - self.keep)
        self.accepted = self.keep * self.accepted + accepted + (1 - self.keep)


def expected_by_size(path_probs: list[float], sizes, factor: float) -> list[float]:
    """Expected tokens of a step (the bonus included) at each of ``sizes`` (nodes, root included) of a best-first
    tree whose nodes have ``path_probs`` (root first): 1 + ``factor`` x the first size - 1 drafts' probabilities.

    >>> expected_by_size([1.0, 0.5, 0.25], [1, 2, 3, 5], 1.0)
    [1.0, 1.5, 1.75, 1.75]
    """
    total, sums = 0.0, [0.0]
    for p in path_probs[1:]:
        total += p
        sums.append(total)
    return [1.0 + factor * sums[min(n, len(sums)) - 1] for n in sizes]


def choose_size(path_probs: list[float], sizes, step_ms, factor: float) -> int:
    """The number of nodes (root included, at most ``len(path_probs)``) with the most expected tokens per ms: 1 +
    ``factor`` x the drafts' path probabilities over the step time interpolated from ``step_ms`` at ``sizes``; the
    smaller on a tie.

    >>> choose_size([1.0, 0.9, 0.8, 0.1], [1, 4], [10.0, 13.0], 1.0)  # 2.7 / 12 ms beats 2.8 / 13 ms
    3
    >>> choose_size([1.0, 0.1, 0.05], [1, 4], [10.0, 13.0], 1.0)      # nothing pays
    1
    """
    best, best_rate, tokens = 1, 0.0, 1.0
    for n in range(1, len(path_probs) + 1):
        if n > 1:
            tokens += factor * path_probs[n - 1]
        rate = tokens / step_time(sizes, step_ms, n)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


class DynamicRecyclingDrafter(RecyclingDrafter):
    """Token Recycling whose draft tree is grown best-first each step (``grow_best_first``) from a matrix that keeps
    probabilities, and whose update writes each tree token's row with its top-k ids and their probabilities.

    The node budget is ``max_nodes`` draft nodes every step or, with ``budget`` (a ``TreeBudget``, shared, not
    copied), the size this step's path probabilities favour over the budget's step-time estimates (``choose_size``,
    up to the budget's largest size; see the module docstring); give one of them. The budget learns the step times
    (scaled to its best size by its estimated curve) and, for its chart, which best-first places were accepted;
    ``calibration`` (shareable, like the budget) how many drafts were accepted per unit of path probability.

    ``last_path_probs``: the path probability of every node of the tree proposed last, in its BFS order (root 1.0).
    """

    name = "tr-dynamic"
    wants_probs = True

    def __init__(self, matrix: AdjacencyMatrix, max_nodes: int | None = None, budget: TreeBudget | None = None,
                 seed_from_prompt: bool = False, calibration: PathCalibration | None = None, max_grow: int = 32):
        if (max_nodes is None) == (budget is None):
            raise ValueError("give the dynamic drafter either max_nodes or a tree budget, not both or neither")
        if max_nodes is not None and max_nodes < 0:
            raise ValueError(f"max_nodes must be at least 0, got {max_nodes}")
        super().__init__(matrix, chain_tree(0), seed_from_prompt)
        self.max_nodes, self.budget = max_nodes, budget
        self.calibration, self.max_grow = calibration or PathCalibration(), max_grow
        self.last_path_probs: list[float] = [1.0]
        self._predicted = 0.0
        self._positions: list[int] = [0]  # each tree node's place in best-first order (root 0)

    def propose(self, context: torch.Tensor) -> Draft:
        root = int(context[-1])
        report: dict = {}
        if self.budget is None:
            tokens, parents, ranks, path_probs = grow_best_first(self.matrix, root, self.max_nodes)
            chosen = None
        else:
            tokens, parents, ranks, path_probs = grow_best_first(
                self.matrix, root, min(self.budget.sizes[-1], self.max_grow + 1) - 1)
            n, report = self._size(path_probs)
            tokens, parents, ranks, path_probs = tokens[:n], parents[:n], ranks[:n], path_probs[:n]
            chosen = n - 1
        n = len(tokens) - 1
        self.tree, order = tree_from_parents(parents, ranks, name="dynamic", sources=["root"] + ["best-first"] * n)
        self._positions = order  # the tree's node j was popped order[j]-th
        self.last_path_probs = [path_probs[i] for i in order]
        drafted = torch.tensor([tokens[i] for i in order], dtype=torch.long, device=context.device)
        return Draft(drafted, self.tree, chosen, report)

    def _size(self, path_probs: list[float]) -> tuple[int, dict]:
        """This step's size (nodes, root included) by ``choose_size``, and what it was chosen from, in the budget's
        terms, with the expected tokens of this step's own tree at every size."""
        budget, factor = self.budget, self.calibration.factor
        step_ms = budget.step_ms()
        n = choose_size(path_probs, budget.sizes, step_ms, factor)
        expected = expected_by_size(path_probs, budget.sizes, factor)
        report = {**budget.estimates(), "step_ms": [round(t, 3) for t in step_ms],
                  "expected_tokens": [round(t, 4) for t in expected],
                  "tokens_per_s": [round(1e3 * t / ms, 3) for t, ms in zip(expected, step_ms)],
                  "best": n - 1, "explored": False, "chosen_by": "path probabilities",
                  "calibration": round(factor, 4)}
        self._predicted = sum(path_probs[1:n])  # the drafts' path probabilities, before calibration
        return n, report

    def learn(self, outcome: Outcome) -> list[RowUpdate]:
        """Overwrite the rows of the tree's tokens with their top-k ids and probabilities; returns each distinct
        token's row change, in order of first occurrence. With a budget, where the whole tree was verified, teach
        the calibration how many drafts were accepted, the budget the accepted nodes' places and the step's time
        (scaled to its best size by its estimated curve)."""
        rows = super().learn(outcome)
        if self.budget is not None and not outcome.is_prompt and outcome.whole:
            path = outcome.host.path if outcome.host is not None else outcome.path.tolist()
            budget = self.budget
            self.calibration.observe(self._predicted, len(path) - 1)
            budget.running(budget.best)
            if self.tree.size == budget.sizes[budget.best]:  # the budget's own size ran (a best-first prefix): places
                budget.observe_path([self._positions[i] for i in path[1:]])
            budget.observe_scaled_time(outcome.forward_ms, self.tree.size)
        return rows

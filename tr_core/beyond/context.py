"""Token Recycling with the context's continuation: ``ContextRecyclingDrafter`` ("tr-context") grafts the most
frequent continuation of the longest context match (``ngrams.ContextIndex``) onto Token Recycling's tree as one more
branch at the root; ``split_budget`` shares the node budget between the two by the step-time curve.
``PlusRecyclingDrafter`` ("tr-plus") does the same on the best-first tree of ``dynamic.py``.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Sequence

import torch

from ..budget import TreeBudget, step_time
from ..drafters import AdaptiveRecyclingDrafter, Draft, NestedTrees, Outcome, RecyclingDrafter
from ..events import RowUpdate
from ..matrix import AdjacencyMatrix
from ..tree import TreeBuffers, tree_from_parents
from .dynamic import PathCalibration, expected_by_size, grow_best_first
from .ngrams import ContextIndex, caught_up

# --- sharing the node budget between the matrix tree and the context branch ------------------------------------------

MATCH_BUCKETS = (1, 2, 3, 4, 8)  # the smallest match length of each bucket: 1, 2, 3, 4-7, 8 and more


class BranchAcceptance:
    """Per match-length bucket, a running estimate (exponentially weighted, at ``rate``) of the probability that
    the context branch's node j (0 = the root's child) is accepted, from a prior of ``first`` for node 0, halving
    at each node deeper.

    >>> b = BranchAcceptance(max_branch=3, rate=0.5)
    >>> b.observe(5, [True, False]); b.estimates(6)
    [0.75, 0.125, 0.125]
    """

    def __init__(self, max_branch: int = 10, first: float = 0.5, rate: float = 0.1):
        self.max_branch, self.rate = max_branch, rate
        self.table = [[first * 0.5 ** j for j in range(max_branch)] for _ in MATCH_BUCKETS]

    @staticmethod
    def bucket(match: int) -> int:
        return max(0, bisect_left(MATCH_BUCKETS, match + 1) - 1)

    def estimates(self, match: int) -> list[float]:
        return self.table[self.bucket(match)]

    def observe(self, match: int, accepted: Sequence[bool]) -> None:
        """Move node j's estimate for ``match`` towards 1 or 0 by ``accepted[j]``, for the nodes it names."""
        row = self.table[self.bucket(match)]
        for j, hit in enumerate(accepted[:self.max_branch]):
            row[j] += self.rate * (float(hit) - row[j])


def split_budget(sizes: Sequence[int], step_ms: Sequence[float], expected_tokens: Sequence[float],
                 branch: Sequence[float], max_size: int, min_size: int = 1) -> tuple[int, int]:
    """The matrix tree's size n (one of the candidate ``sizes``, nodes with the root, from ``min_size`` to
    ``max_size``) and the context branch's length L (0 .. ``len(branch)``, ``branch[j]`` node j's acceptance
    estimate) with the most expected tokens per ms: (``expected_tokens`` at n + ``sum(branch[:L])``) / t(n + L), t
    interpolated from ``step_ms`` at ``sizes`` (``step_time``). The smaller n, then the shorter branch, on a tie.
    Branch nodes that coincide with the matrix tree's count in both sums and in t (the graft merges them, so the
    step runs fewer nodes than n + L).

    >>> split_budget([1, 3], [10.0, 12.0], [1.0, 1.5], [0.9, 0.8, 0.1], max_size=3)  # (1.5 + 1.7) / 14 ms
    (3, 2)
    >>> split_budget([1, 3], [10.0, 30.0], [1.0, 1.5], [0.9, 0.8, 0.1], max_size=3)  # (1 + 0.9) / 20 ms
    (1, 0)
    """
    gains = [0.0]
    for p in branch:
        gains.append(gains[-1] + p)
    times = [step_time(sizes, step_ms, n) for n in range(max_size + len(branch) + 1)]
    best, best_rate = (max_size, 0), -1.0
    for size, tokens in zip(sizes, expected_tokens):
        if not min_size <= size <= max_size:
            continue
        for length, gain in enumerate(gains):
            rate = (tokens + gain) / times[size + length]
            if rate > best_rate:
                best, best_rate = (size, length), rate
    return best


def graft(tokens: list[int], parents: list[int], chain: Sequence[int]) -> tuple[list[int], list[int]]:
    """``chain`` grafted at the root of the tree (``tokens``, ``parents``; parents before children): a chain token
    equal to a child's token of the node reached continues down that child (the first such), the others become new
    nodes, appended. Returns the tree's tokens and parents, with the new nodes last.

    >>> graft([7, 1, 2, 3], [-1, 0, 0, 1], [1, 3, 9])  # 1 and 3 exist: 9 hangs under node 3
    ([7, 1, 2, 3, 9], [-1, 0, 0, 1, 3])
    """
    first: dict[tuple[int, int], int] = {}
    for i in range(len(tokens) - 1, 0, -1):  # backwards: the first child with a token wins
        first[parents[i], tokens[i]] = i
    tokens, parents, node = list(tokens), list(parents), 0
    for t in chain:
        child = first.get((node, t))
        if child is None:
            child = len(tokens)
            tokens.append(t)
            parents.append(node)
            first[node, t] = child
        node = child
    return tokens, parents


def _agreement(chain: Sequence[int], produced: Sequence[int]) -> int:
    """How many leading tokens of ``chain`` the step produced (its accepted tokens, then the bonus token)."""
    n = 0
    while n < min(len(chain), len(produced)) and chain[n] == produced[n]:
        n += 1
    return n


class ContextRecyclingDrafter(AdaptiveRecyclingDrafter):
    """Token Recycling with a context branch: each step, the matrix tree of a tree budget's nested trees, and the
    likeliest continuation of the context's longest match grafted at the root (``graft``; the branch's new nodes
    have source "context", rank -1). ``split_budget`` chooses the matrix tree's size (at most the budget's choice)
    and the branch's length (at most ``max_branch``) from the budget's estimates and ``branch``'s acceptance
    estimates for the match's length. ``branch`` may be shared across requests, like the budget.

    Learning: the rows of every verified token (matrix and context nodes) are rewritten, as in Token Recycling; the
    budget learns only about the matrix tree it ran (its accepted nodes' positions, and the step time scaled to that
    tree's size by the estimated curve); the branch estimates learn, per node, whether its tokens were produced, for
    every drafted node and for the undrafted ones whose outcome the step's tokens tell (node j, j <= accepted).
    """

    name = "tr-context"

    def __init__(self, matrix: AdjacencyMatrix, nested: NestedTrees, budget: TreeBudget,
                 seed_from_prompt: bool = False, max_branch: int = 10, max_match: int = 16,
                 max_occurrences: int = 16, branch: BranchAcceptance | None = None):
        super().__init__(matrix, nested, budget, seed_from_prompt)
        self.branch = branch or BranchAcceptance(max_branch)
        self.max_branch, self.max_occurrences = min(max_branch, self.branch.max_branch), max_occurrences
        self.index = ContextIndex(max_match=max_match)
        self._parents = [t.parents.tolist() for t in self.nested.trees]
        self._ranks = [t.ranks.tolist() for t in self.nested.trees]
        self._matrix_nodes: list[int] = []  # per node of the tree proposed: its matrix tree node, or -1
        self._chain: list[int] = []  # the match's continuation (up to max_branch tokens); the first _drafted drafted
        self._drafted = self._match = 0
        self._unmerged: tuple[int, list[int], list[int]] | None = None  # the last step's graft, where unmerged
        self._step_ms: list[float] = []  # the budget's estimated step time at each size, this step

    def propose(self, context: torch.Tensor) -> Draft:
        self.index = caught_up(self.index, context)
        trie = self.index.continuations(self.max_branch, self.max_occurrences)
        self._match, self._chain = trie.match, trie.chain(self.max_branch)
        size, length, report = self._split()
        i = self._index[size]
        self.budget.running(i, self.budget.exploring)  # the budget learns about the matrix tree that runs
        self._positions, self._drafted = self.nested.positions[i], length
        retrieved = self.matrix.retrieve(int(context[-1]), self.nested.trees[i])
        tokens, self.tree = self._graft(retrieved, i, self._chain[:length])
        # context_branch: the nodes the branch added (its tokens the matrix tree already held are merged)
        report.update(context_branch=self.tree.size - size, branch_length=length, match=self._match,
                      matrix_nodes=size - 1)
        return Draft(tokens, self.tree, self.tree.size - 1, report)

    def _split(self) -> tuple[int, int, dict]:
        """The budget's choice, shared between the matrix tree and the branch (``split_budget``): at most the size
        it chose, exactly that size on a step where it explores a neighbour of its best; and the budget's
        estimates it was made from."""
        budget = self.budget
        chosen = budget.choose()
        report = budget.estimates()
        self._step_ms = report["step_ms"]
        return (*split_budget(budget.sizes, self._step_ms, report["expected_tokens"],
                              self.branch.estimates(self._match)[:len(self._chain)], chosen,
                              chosen if budget.exploring else 1), report)

    def _graft(self, tokens: torch.Tensor, i: int, chain: list[int]) -> tuple[torch.Tensor, TreeBuffers]:
        """The matrix tree ``nested.trees[i]`` with its ``tokens`` (n,) and ``chain`` grafted at its root; keeps
        ``_matrix_nodes``, each node's matrix tree node (-1: a new, context node)."""
        matrix_tree = self.nested.trees[i]
        n = matrix_tree.size
        self._unmerged = None
        if chain and not self.matrix.on_host():
            # on a device the retrieved tokens are not read back to merge the branch with the matrix tree's nodes:
            # the branch hangs whole under the root (a node it shares with the matrix tree is verified twice, at the
            # same logits: the step's tokens and the rows it rewrites are those of the merge); ``learn`` finds the
            # twins from the step's read and teaches the budget as the merge would
            drafted, parents = None, self._parents[i] + [0] + list(range(n, n + len(chain) - 1))
        else:
            drafted, parents = graft(tokens.tolist(), self._parents[i], chain) if chain else ([], [])
        new = len(parents) - n
        if new <= 0:  # no branch, or the matrix tree holds it whole
            self._matrix_nodes = list(range(n))
            return tokens, matrix_tree
        tree, order = tree_from_parents(parents, self._ranks[i] + [-1] * new, name="tr-context",
                                        sources=["root"] + ["matrix"] * (n - 1) + ["context"] * new)
        self._matrix_nodes = [j if j < n else -1 for j in order]
        if drafted is None:
            self._unmerged = (i, list(chain), order)
            whole = torch.cat([tokens, torch.tensor(chain, dtype=torch.long).to(tokens.device)])
            return whole[torch.tensor(order).to(tokens.device)], tree
        return torch.tensor([drafted[j] for j in order], dtype=torch.long, device=tokens.device), tree

    def learn(self, outcome: Outcome) -> list[RowUpdate]:
        """Rewrite the rows of every node's token (``RecyclingDrafter.learn``); teach the budget the accepted
        matrix nodes and the step's time (scaled to the matrix tree's size), and the branch estimates the branch's
        outcome (see the class docstring)."""
        rows = RecyclingDrafter.learn(self, outcome)
        if outcome.is_prompt or not outcome.whole:
            return rows  # the draft was cut (the context's or a window's end): nothing to learn about it
        tokens, path, top, host = outcome.tokens, outcome.path, outcome.top, outcome.host
        nodes = host.path if host is not None else path.tolist()
        size = self.tree.size
        if self._unmerged is not None and host is not None:
            size -= self._merge_twins(host.tokens)
        self._teach_matrix([m for m in (self._matrix_nodes[i] for i in nodes[1:]) if m >= 0])
        if self._chain:
            # the accepted tokens, then the likeliest next token: the bonus token of greedy decoding; in sampled
            # decoding it stands in for the sampled bonus (which the loop does not hand over). Learning only: the
            # output is the verifier's whatever the branch estimates say
            if host is not None:
                produced = [host.tokens[i] for i in nodes[1:]] + [host.top[nodes[-1]][0]]
            else:
                produced = tokens[path[1:]].tolist() + [int(top[nodes[-1], 0])]
            agree = _agreement(self._chain, produced)
            known = max(self._drafted, len(nodes))  # drafted nodes, and those the produced tokens decide
            self.branch.observe(self._match, [j < agree for j in range(min(known, len(self._chain)))])
        self.budget.observe_scaled_time(outcome.forward_ms, size, self._step_ms)
        return rows

    def _merge_twins(self, tokens: list[int]) -> int:
        """After an unmerged graft (``_graft`` on a device), with the step's tokens read: each branch node that the
        merge would have found in the matrix tree (the same tokens from the root) counts as that matrix node, as
        in a merged step; returns how many there were (the nodes the merge would have saved)."""
        i, chain, order = self._unmerged
        place = {old: new for new, old in enumerate(order)}  # input index (matrix nodes, then the branch) -> node
        parents, n = self._parents[i], self.nested.trees[i].size
        first: dict[tuple[int, int], int] = {}
        for m in range(n - 1, 0, -1):  # backwards: the first child with a token wins, as in graft
            first[parents[m], tokens[place[m]]] = m
        node, twins = 0, 0
        for k, t in enumerate(chain):
            node = first.get((node, t))
            if node is None:
                break
            self._matrix_nodes[place[n + k]] = node
            twins += 1
        return twins

    def _teach_matrix(self, accepted: list[int]) -> None:
        """The budget learns the accepted matrix nodes (indices into the matrix tree), by likeliest-first place."""
        self.budget.observe_path([self._positions[m] for m in accepted])


class PlusRecyclingDrafter(ContextRecyclingDrafter):
    """``tr-plus``: the context branch of ``ContextRecyclingDrafter`` grafted onto the best-first tree of
    ``dynamic.grow_best_first``, in one node budget: ``split_budget`` weighs the best-first tree's expected tokens at
    each size (this step's path probabilities, calibrated: ``dynamic.PathCalibration``) and the branch's against the
    budget's step-time estimates. The budget learns step times (scaled to its best size); the calibration, the
    accepted best-first nodes. The matrix must keep probabilities (``AdjacencyMatrix.with_probs``)."""

    name = "tr-plus"
    wants_probs = True

    def __init__(self, matrix: AdjacencyMatrix, nested: NestedTrees, budget: TreeBudget,
                 seed_from_prompt: bool = False, calibration: PathCalibration | None = None, max_grow: int = 32,
                 **options):
        super().__init__(matrix, nested, budget, seed_from_prompt, **options)
        self.calibration, self.max_grow = calibration or PathCalibration(), max_grow
        self._predicted: list[float] = []  # the drafted best-first nodes' path probabilities (root first)

    def propose(self, context: torch.Tensor) -> Draft:
        self.index = caught_up(self.index, context)
        trie = self.index.continuations(self.max_branch, self.max_occurrences)
        self._match, self._chain = trie.match, trie.chain(self.max_branch)
        budget = self.budget
        tokens, parents, ranks, path_probs = grow_best_first(self.matrix, int(context[-1]),
                                                             min(budget.sizes[-1], self.max_grow + 1) - 1)
        # the best-first tree's sizes priced on the budget's own candidate sizes and step times (a tree that stops
        # short, at a cold root, is priced as the candidate size it falls in: its branch nodes are never free)
        estimated = budget.step_ms()
        expected = expected_by_size(path_probs, budget.sizes, self.calibration.factor)
        size, length = split_budget(budget.sizes, estimated, expected,
                                    self.branch.estimates(self._match)[:len(self._chain)], budget.sizes[-1])
        size = min(size, len(tokens))
        budget.running(budget.best)  # learn: the time scaled to the budget's best size
        self._step_ms = estimated
        tokens, parents, ranks, self._predicted = tokens[:size], parents[:size], ranks[:size], path_probs[:size]
        self._drafted = length
        drafted, parents = graft(tokens, parents, self._chain[:length])
        new = len(drafted) - size
        self.tree, order = tree_from_parents(parents, ranks + [-1] * new, name="tr-plus",
                                             sources=["root"] + ["best-first"] * (size - 1) + ["context"] * new)
        self._matrix_nodes = [j if j < size else -1 for j in order]
        report = {**budget.estimates(), "step_ms": [round(t, 3) for t in estimated],
                  "expected_tokens": [round(t, 4) for t in expected_by_size(path_probs, budget.sizes,
                                                                            self.calibration.factor)],
                  "best": size - 1, "explored": False, "chosen_by": "path probabilities",
                  "calibration": round(self.calibration.factor, 4), "context_branch": new,
                  "branch_length": length, "match": self._match, "matrix_nodes": size - 1}
        report["tokens_per_s"] = [round(1e3 * t / ms, 3) for t, ms in zip(report["expected_tokens"], estimated)]
        drafted = torch.tensor([drafted[j] for j in order], dtype=torch.long, device=context.device)
        return Draft(drafted, self.tree, self.tree.size - 1, report)

    def _teach_matrix(self, accepted: list[int]) -> None:
        self.calibration.observe(sum(self._predicted[1:]), len(accepted))

"""Drafts from the context: what followed earlier occurrences of the sequence's last tokens.

``ContextIndex`` keeps, for the prompt and the answer so far, every n-gram (n up to ``max_match``) with the
positions where it ended, so the longest earlier match of the sequence's end is a few dictionary look-ups, whatever
the context's length. Its ``continuations`` are the tokens that followed the match's latest occurrences, as a
frequency trie:

    [1, 2, 3, 1, 2, 4, 1, 2]  ->  match [1, 2] (ended at 1 and 4)  ->  root 2 -> 3 (1 of 2) -> 1 -> 2 ...
                                                                               -> 4 (1 of 2) -> 1 -> 2

Two drafters draft from it:

- ``SuffixDrafter`` ("suffix"): a training-free baseline after SuffixDecoding (Oliaro et al., arXiv 2411.04975),
  which speculates with a tree of the most frequent continuations of the longest suffix match. Here the tree is
  grown best-first in the trie of the current request's context (SuffixDecoding also indexes earlier outputs).
- ``ContextRecyclingDrafter`` ("tr-context"): Token Recycling's tree with the match's continuation grafted onto it
  as one more branch at the root; ``split_budget`` shares the node budget between the two by the step-time curve.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from typing import Iterable, Sequence

import torch

from .budget import TreeBudget, step_time
from .drafters import AdaptiveRecyclingDrafter, NestedTrees, PlainDrafter, RecyclingDrafter
from .dynamic import PathCalibration, expected_by_size, grow_best_first
from .events import RowUpdate
from .matrix import AdjacencyMatrix
from .tree import TreeBuffers, chain_tree, tree_from_parents


@dataclass(frozen=True)
class Continuations:
    """What followed the latest ``occurrences`` earlier occurrences of the longest match (``match`` tokens; 0: none,
    then the trie is the root alone), as a frequency trie. Per node (node 0 the root, the sequence's last token;
    every parent before its children): ``tokens``, ``parents`` (-1 for the root), ``counts`` (the occurrences that
    continue through it; the root: all) and ``children`` (in insertion order: the latest occurrence's first).
    ``counts[i] / occurrences`` is node i's estimated probability, the product of the count ratios along its path.
    """

    match: int
    occurrences: int
    tokens: list[int]
    parents: list[int]
    counts: list[int]
    children: list[list[int]]

    def best_first(self, max_nodes: int) -> list[int]:
        """Up to ``max_nodes`` node indices (root not counted), likeliest first (the earlier node on a tie), each
        after its parent: best-first growth from the root. Among equals the earlier node is the latest occurrence's.

        >>> trie = ContextIndex([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]).continuations(depth=2)
        >>> trie.tokens, trie.counts, trie.best_first(3)
        ([2, 4, 1, 3, 1], [3, 1, 1, 2, 2], [3, 4, 1])
        """
        heap = [(-self.counts[c], c) for c in self.children[0]]
        heapify(heap)
        chosen: list[int] = []
        while heap and len(chosen) < max_nodes:
            node = heappop(heap)[1]
            chosen.append(node)
            for c in self.children[node]:
                heappush(heap, (-self.counts[c], c))
        return chosen

    def chain(self, length: int) -> list[int]:
        """The tokens of the likeliest path, at most ``length``: from the root, each node's most frequent child (the
        latest occurrence's on a tie).

        >>> ContextIndex([1, 2, 3, 1, 2, 4, 1, 2]).continuations(depth=4).chain(3)
        [4, 1, 2]
        """
        out, node = [], 0
        while len(out) < length and self.children[node]:
            node = max(self.children[node], key=self.counts.__getitem__)  # max keeps the first of equals
            out.append(self.tokens[node])
        return out


class ContextIndex:
    """An incremental n-gram index over a token sequence: for every n-gram of up to ``max_match`` tokens, the
    positions where it ended, ascending. ``extend`` costs O(new tokens x max_match); ``longest_match`` a few look-ups,
    independent of the sequence's length.

    Matches longer than ``max_match`` count as ``max_match``: the occurrences found are those of the last
    ``max_match`` tokens (a drafter follows the latest of them), though an older one may have matched longer.

    >>> index = ContextIndex([5, 6, 7, 8, 9, 5, 6])
    >>> index.longest_match()
    (2, [1])
    >>> index.extend([9]); index.longest_match()
    (1, [4])
    """

    def __init__(self, tokens: Iterable[int] = (), max_match: int = 16):
        if max_match < 1:
            raise ValueError(f"a context index needs max_match >= 1, got {max_match}")
        self.max_match = max_match
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append ``tokens`` and index the n-grams that end at each."""
        seq, ends = self.tokens, self._ends
        for t in tokens:
            seq.append(t)
            end = len(seq) - 1
            for n in range(1, min(self.max_match, end + 1) + 1):
                ends.setdefault(tuple(seq[end - n + 1:]), []).append(end)

    def _earlier(self, n: int) -> list[int]:
        """The end positions of the last ``n`` tokens' occurrences, this one (the last position) included."""
        return self._ends.get(tuple(self.tokens[len(self.tokens) - n:]), [])

    def longest_match(self, limit: int | None = None) -> tuple[int, list[int]]:
        """The length m of the longest suffix that occurred before (ending before the last position; at most
        ``max_match``; 0: none) and the end positions of its latest ``limit`` earlier occurrences (all: None),
        ascending."""
        # a suffix that occurred before contains shorter ones that did too: binary search over n
        lo, hi = 0, min(self.max_match, len(self.tokens) - 1)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self._earlier(mid)) > 1:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return 0, []
        ends = self._earlier(lo)
        return lo, ends[max(0, len(ends) - 1 - limit) if limit is not None else 0:-1]

    def continuations(self, depth: int, max_occurrences: int = 16) -> Continuations:
        """The up to ``depth`` tokens that followed each of the longest match's latest ``max_occurrences`` earlier
        occurrences, as a frequency trie (see ``Continuations``)."""
        match, ends = self.longest_match(max_occurrences)
        root = self.tokens[-1] if self.tokens else -1
        tokens, parents, counts, children = [root], [-1], [len(ends)], [[]]
        first: dict[tuple[int, int], int] = {}  # (parent, token) -> node
        for end in reversed(ends):  # the latest first: its nodes come first among equals
            node = 0
            for t in self.tokens[end + 1:end + 1 + depth]:
                child = first.get((node, t))
                if child is None:
                    child = first[node, t] = len(tokens)
                    tokens.append(t)
                    parents.append(node)
                    counts.append(0)
                    children.append([])
                    children[node].append(child)
                counts[child] += 1
                node = child
        return Continuations(match, len(ends), tokens, parents, counts, children)


def caught_up(index: ContextIndex, context: torch.Tensor) -> ContextIndex:
    """``index`` extended with the tokens of ``context`` (L,) it has not seen yet: the decoding loop only ever
    appends to a request's context (a shorter one starts a new index)."""
    if context.numel() < len(index):
        index = ContextIndex(max_match=index.max_match)
    if context.numel() > len(index):
        index.extend(context[len(index):].tolist())
    return index


class SuffixDrafter(PlainDrafter):
    """Speculation from the context alone: a tree of at most ``max_nodes`` draft nodes (the root extra), grown
    best-first from the continuations of the longest match (at least ``min_match`` tokens) over its latest
    ``max_occurrences`` occurrences; no match: the root alone. A drafter per request: it indexes the context it is
    given.

    >>> tokens, tree = SuffixDrafter(max_nodes=4).propose(torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]), 2)
    >>> tokens.tolist(), tree.parents.tolist(), tree.sources[:2]
    ([2, 3, 4, 1, 2], [-1, 0, 0, 1, 3], ('root', 'context'))
    """

    name = "suffix"

    def __init__(self, max_nodes: int = 8, max_match: int = 16, min_match: int = 1, max_occurrences: int = 16):
        if max_nodes < 1 or min_match < 1 or max_occurrences < 1:
            raise ValueError("a suffix drafter needs max_nodes, min_match and max_occurrences >= 1")
        self.max_nodes, self.min_match, self.max_occurrences = max_nodes, min_match, max_occurrences
        self.index = ContextIndex(max_match=max_match)

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]:
        self.index = caught_up(self.index, context)
        trie = self.index.continuations(self.max_nodes, self.max_occurrences)
        nodes = trie.best_first(self.max_nodes) if trie.match >= self.min_match else []
        if not nodes:
            return context[-1:].clone(), chain_tree(0)
        place = {node: i for i, node in enumerate(nodes, start=1)}
        parents = [-1] + [place.get(trie.parents[node], 0) for node in nodes]
        tree, order = tree_from_parents(parents, [0] + [-1] * len(nodes), name="suffix",
                                        sources=["root"] + ["context"] * len(nodes))
        drafted = [root] + [trie.tokens[node] for node in nodes]
        return torch.tensor([drafted[i] for i in order], dtype=torch.long, device=context.device), tree


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
        self._report: dict = {}
        self._matrix_nodes: list[int] = []  # per node of the tree proposed: its matrix tree node, or -1
        self._chain: list[int] = []  # the match's continuation (up to max_branch tokens); the first _drafted drafted
        self._drafted = self._match = 0
        self._step_ms: list[float] = []  # the budget's estimated step time at each size, this step

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]:
        self.index = caught_up(self.index, context)
        trie = self.index.continuations(self.max_branch, self.max_occurrences)
        self._match, self._chain = trie.match, trie.chain(self.max_branch)
        size, length = self._split()
        i = self._index[size]
        self.budget.current = i  # the budget learns about the matrix tree that runs (observe_path, observe_time)
        self._positions, self._drafted = self.nested.positions[i], length
        tokens, self.tree = self._graft(self.matrix.retrieve(root, self.nested.trees[i]), i, self._chain[:length])
        # context_branch: the nodes the branch added (its tokens the matrix tree already held are merged)
        self._report.update(context_branch=self.tree.size - size, branch_length=length, match=self._match,
                            matrix_nodes=size - 1)
        return tokens, self.tree

    def _split(self) -> tuple[int, int]:
        """The budget's choice, shared between the matrix tree and the branch (``split_budget``): at most the size
        it chose, exactly that size on a step where it explores a neighbour of its best."""
        budget = self.budget
        chosen = budget.choose()
        self._report = budget.estimates()
        self._step_ms = self._report["step_ms"]
        return split_budget(budget.sizes, self._step_ms, self._report["expected_tokens"],
                            self.branch.estimates(self._match)[:len(self._chain)], chosen,
                            chosen if budget.exploring else 1)

    def _graft(self, tokens: torch.Tensor, i: int, chain: list[int]) -> tuple[torch.Tensor, TreeBuffers]:
        """The matrix tree ``nested.trees[i]`` with its ``tokens`` (n,) and ``chain`` grafted at its root; keeps
        ``_matrix_nodes``, each node's matrix tree node (-1: a new, context node)."""
        matrix_tree = self.nested.trees[i]
        n = matrix_tree.size
        drafted, parents = graft(tokens.tolist(), self._parents[i], chain) if chain else ([], [])
        new = len(drafted) - n
        if new <= 0:  # no branch, or the matrix tree holds it whole
            self._matrix_nodes = list(range(n))
            return tokens, matrix_tree
        tree, order = tree_from_parents(parents, self._ranks[i] + [-1] * new, name="tr-context",
                                        sources=["root"] + ["matrix"] * (n - 1) + ["context"] * new)
        self._matrix_nodes = [j if j < n else -1 for j in order]
        return torch.tensor([drafted[j] for j in order], dtype=torch.long, device=tokens.device), tree

    def update(self, tokens: torch.Tensor, path: torch.Tensor, top: torch.Tensor | None,
               probs: torch.Tensor | None = None) -> list[RowUpdate]:
        """Rewrite the rows of every node's token (``RecyclingDrafter.update``); teach the budget the accepted
        matrix nodes and the branch estimates the branch's outcome (see the class docstring)."""
        rows = RecyclingDrafter.update(self, tokens, path, top, probs)
        self._timed = tokens.numel() == self.tree.size
        if not self._timed:
            return rows  # the root alone was verified (the context's end): nothing to learn about the draft
        nodes = path.tolist()
        self._teach_matrix([m for m in (self._matrix_nodes[i] for i in nodes[1:]) if m >= 0])
        if self._chain:
            # the accepted tokens, then the likeliest next token: the bonus token of greedy decoding; in sampled
            # decoding it stands in for the sampled bonus (which the loop does not hand over). Learning only: the
            # output is the verifier's whatever the branch estimates say
            produced = tokens[path[1:]].tolist() + [int(top[nodes[-1], 0])]
            agree = _agreement(self._chain, produced)
            known = max(self._drafted, len(nodes))  # drafted nodes, and those the produced tokens decide
            self.branch.observe(self._match, [j < agree for j in range(min(known, len(self._chain)))])
        return rows

    def _teach_matrix(self, accepted: list[int]) -> None:
        """The budget learns the accepted matrix nodes (indices into the matrix tree), by likeliest-first place."""
        self.budget.observe_path([self._positions[m] for m in accepted])

    def observe(self, forward_ms: float) -> None:
        if self._timed:  # the time of the matrix tree alone, by the ratio of the estimated step times
            ran = step_time(self.budget.sizes, self._step_ms, self.tree.size)
            self.budget.observe_time(forward_ms * self._step_ms[self.budget.current] / ran)

    def budget_report(self) -> tuple[int | None, dict]:
        return self.tree.size - 1, self._report


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
        if matrix.probs is None:
            raise ValueError("tr-plus needs a matrix that keeps probabilities: call with_probs() first")
        super().__init__(matrix, nested, budget, seed_from_prompt, **options)
        self.calibration, self.max_grow = calibration or PathCalibration(), max_grow
        self._predicted: list[float] = []  # the drafted best-first nodes' path probabilities (root first)

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]:
        self.index = caught_up(self.index, context)
        trie = self.index.continuations(self.max_branch, self.max_occurrences)
        self._match, self._chain = trie.match, trie.chain(self.max_branch)
        budget = self.budget
        tokens, parents, ranks, path_probs = grow_best_first(self.matrix, root,
                                                             min(budget.sizes[-1], self.max_grow + 1) - 1)
        # the best-first tree's sizes priced on the budget's own candidate sizes and step times (a tree that stops
        # short, at a cold root, is priced as the candidate size it falls in: its branch nodes are never free)
        estimated = budget.step_ms()
        expected = expected_by_size(path_probs, budget.sizes, self.calibration.factor)
        size, length = split_budget(budget.sizes, estimated, expected,
                                    self.branch.estimates(self._match)[:len(self._chain)], budget.sizes[-1])
        size = min(size, len(tokens))
        budget.current, budget.exploring = budget.best, False  # observe: the time scaled to the budget's best size
        self._step_ms = estimated
        tokens, parents, ranks, self._predicted = tokens[:size], parents[:size], ranks[:size], path_probs[:size]
        self._drafted = length
        drafted, parents = graft(tokens, parents, self._chain[:length])
        new = len(drafted) - size
        self.tree, order = tree_from_parents(parents, ranks + [-1] * new, name="tr-plus",
                                             sources=["root"] + ["best-first"] * (size - 1) + ["context"] * new)
        self._matrix_nodes = [j if j < size else -1 for j in order]
        self._report = {**budget.estimates(), "step_ms": [round(t, 3) for t in estimated],
                        "expected_tokens": [round(t, 4) for t in expected_by_size(path_probs, budget.sizes,
                                                                                  self.calibration.factor)],
                        "best": size - 1, "explored": False, "chosen_by": "path probabilities",
                        "calibration": round(self.calibration.factor, 4), "context_branch": new,
                        "branch_length": length, "match": self._match, "matrix_nodes": size - 1}
        self._report["tokens_per_s"] = [round(1e3 * t / ms, 3) for t, ms in zip(self._report["expected_tokens"],
                                                                               estimated)]
        return torch.tensor([drafted[j] for j in order], dtype=torch.long, device=context.device), self.tree

    def _teach_matrix(self, accepted: list[int]) -> None:
        self.calibration.observe(sum(self._predicted[1:]), len(accepted))

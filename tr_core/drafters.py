"""Drafters: where the guessed tokens of a step come from. All three share one verification engine
(``decoding.decode``), which calls them only through the ``Drafter`` protocol below.

Plain decoding proposes the root alone; Prompt Lookup a chain copied from an earlier n-gram match; Token Recycling
a tree retrieved from its adjacency matrix, of a fixed template or, with a tree budget (``budget.TreeBudget``), of
the N likeliest nodes for the N the budget chooses each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from .budget import TreeBudget
from .events import RowUpdate
from .matrix import AdjacencyMatrix
from .tree import Path_, TreeBuffers, build_tree, chain_tree


class Drafter(Protocol):
    """What the decoding loop asks of a drafter, as in transformers' candidate generators (``get_candidates``,
    ``update_candidate_strategy``), plus a hook for the prompt.

    Each step the loop calls ``propose``, then ``budget_report``, verifies the draft in one forward pass, then calls
    ``update`` once, always as ``update(tokens, path, top, probs)``, then ``observe(forward_ms)``. ``n`` is the tree's
    node count, ``V`` the vocabulary size.

    - ``name``: the method's name in events ("plain", "pld", "tr").
    - ``top_k``: how many of each node's best next tokens ``update`` wants (0: none; ``top`` is then None).
    - ``wants_prefill_logits``: whether the loop should compute the prompt's logits for ``on_prefill``.
    - ``wants_probs``: whether ``update`` wants the probabilities of each node's top-k tokens (``probs``).
    - ``propose(context, root)``: ``context`` (L,) int64, the sequence so far, its last token ``root`` not yet in
      the KV cache -> ``(tokens, tree)``: ``tokens`` (n,) int64 with ``tokens[0] == root``, on the context's device,
      and the draft tree of ``n`` nodes in BFS order.
    - ``update(tokens, path, top)``: learn from the verified step. ``tokens`` (n,) as proposed; ``path`` (a + 1,)
      int64, the accepted path's node indices, root first; ``top`` (n, top_k) int64, each node's best next tokens,
      best first (None when ``top_k`` is 0); ``probs`` (n, top_k) float32, their probabilities under the model's
      next-token distribution at each node (None unless ``wants_probs``). Returns the adjacency-matrix rows it
      rewrote (empty: none).
    - ``observe(forward_ms)``: the step's measured forward pass and output layer, in ms (what a tree budget learns
      step times from; the others ignore it).
    - ``budget_report()``: the draft nodes a tree budget chose for the step just proposed and the estimates it chose
      from (``TreeBudget.estimates``), or ``(None, {})`` for a drafter without one.
    - ``on_prefill(ids, logits)``: called only when ``wants_prefill_logits``, in chunks, with ``ids`` (m,) distinct
      prompt tokens in sequence order and ``logits`` (m, V), the next-token logits at each one's last occurrence.
    """

    name: str
    top_k: int
    wants_prefill_logits: bool

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]: ...

    wants_probs: bool

    def update(self, tokens: torch.Tensor, path: torch.Tensor, top: torch.Tensor | None,
               probs: torch.Tensor | None) -> list[RowUpdate]: ...

    def on_prefill(self, ids: torch.Tensor, logits: torch.Tensor) -> None: ...

    def observe(self, forward_ms: float) -> None: ...

    def budget_report(self) -> tuple[int | None, dict]: ...


class PlainDrafter:
    """Plain greedy decoding: no draft, one token per forward pass."""

    name = "plain"
    wants_prefill_logits = False
    wants_probs = False
    top_k = 0

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]:
        return context[-1:].clone(), chain_tree(0)

    def update(self, tokens: torch.Tensor, path: torch.Tensor, top: torch.Tensor | None,
               probs: torch.Tensor | None = None) -> list[RowUpdate]:
        return []

    def on_prefill(self, ids: torch.Tensor, logits: torch.Tensor) -> None:
        pass

    def observe(self, forward_ms: float) -> None:
        pass

    def budget_report(self) -> tuple[int | None, dict]:
        return None, {}


class PromptLookupDrafter(PlainDrafter):
    """Prompt Lookup Decoding: find the latest earlier occurrence of the context's last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) and propose the up to ``max_draft`` tokens that followed it, as a chain.

    >>> d = PromptLookupDrafter(max_ngram=2, max_draft=3)
    >>> d.propose(torch.tensor([5, 6, 7, 8, 9, 5, 6]), 6)[0].tolist()
    [6, 7, 8, 9]
    """

    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 10):
        if not 1 <= min_ngram <= max_ngram or max_draft < 1:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram and max_draft >= 1, got "
                             f"{min_ngram}, {max_ngram}, {max_draft}")
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if context.numel() <= n:
                continue
            # windows over context[:-1] start at 0 .. len-1-n: each match is followed by at least one token
            windows = context[:-1].unfold(0, n, 1)
            hits = (windows == context[-n:]).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                draft = context[start:start + self.max_draft]
                return torch.cat([context[-1:], draft]), chain_tree(draft.numel())
        return super().propose(context, root)


class RecyclingDrafter(PlainDrafter):
    """Token Recycling: retrieve a draft tree from the adjacency matrix, then overwrite the rows of every tree
    token (accepted and rejected, root included) with the top-k of that node's output distribution. ``top_k`` is
    the matrix's k: the loop hands ``update`` each node's k best next tokens."""

    name = "tr"

    def __init__(self, matrix: AdjacencyMatrix, tree: TreeBuffers, seed_from_prompt: bool = False):
        if tree.max_rank >= matrix.k:
            raise ValueError(f"tree {tree.name!r} uses rank {tree.max_rank}, "
                             f"more than the matrix's k={matrix.k} allows")
        self.matrix, self.tree, self.seed_from_prompt = matrix, tree.to(matrix.rows.device), seed_from_prompt
        self.wants_prefill_logits = seed_from_prompt
        self.top_k = matrix.k

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]:
        return self.matrix.retrieve(root, self.tree), self.tree

    def update(self, tokens: torch.Tensor, path: torch.Tensor, top: torch.Tensor | None,
               probs: torch.Tensor | None = None) -> list[RowUpdate]:
        """Overwrite the rows of the tree's tokens with ``top`` (n, k); returns each distinct token's row change, in
        order of first occurrence."""
        distinct = list(dict.fromkeys(tokens.tolist()))  # in order of first occurrence
        old = self.matrix.rows_of(distinct)
        if probs is not None and self.matrix.probs is not None:  # a matrix that keeps probabilities (tr-dynamic)
            self.matrix.update(tokens, top, priority=path, probs=probs)
        else:
            self.matrix.update(tokens, top, priority=path)
        new = self.matrix.rows_of(distinct)
        return [RowUpdate(t, o, n) for t, o, n in zip(distinct, old, new)]

    def on_prefill(self, ids: torch.Tensor, logits: torch.Tensor) -> None:
        if self.seed_from_prompt:
            self.matrix.seed(ids, logits)



@dataclass(frozen=True)
class NestedTrees:
    """The trees of a tree budget, built once: ``trees[i]`` holds the ``sizes[i]`` likeliest nodes (root
    included), and ``positions[i][node]`` is each of its nodes' place in the likeliest-first order (root 0)."""

    sizes: tuple[int, ...]
    trees: tuple[TreeBuffers, ...]
    positions: tuple[tuple[int, ...], ...]

    def to(self, device: torch.device | str) -> "NestedTrees":
        return NestedTrees(self.sizes, tuple(t.to(device) for t in self.trees), self.positions)


def nested_trees(order: Sequence[Path_], sizes: Sequence[int], name: str = "auto") -> NestedTrees:
    """One tree per size from ``order``, the draft nodes' index paths likeliest first (each prefix a tree).

    >>> nested = nested_trees([(1,), (0,), (1, 0)], [1, 2, 4])
    >>> [t.node_paths for t in nested.trees], nested.positions[-1]
    ([((),), ((), (1,)), ((), (0,), (1,), (1, 0))], (0, 2, 1, 3))
    """
    place = {tuple(p): j for j, p in enumerate(order, start=1)}
    place[()] = 0
    trees = tuple(build_tree([tuple(p) for p in order[:n - 1]], name=name) for n in sizes)
    positions = tuple(tuple(place[p] for p in t.node_paths) for t in trees)
    return NestedTrees(tuple(sizes), trees, positions)


class AdaptiveRecyclingDrafter(RecyclingDrafter):
    """Token Recycling with a tree budget: each step drafts the N likeliest nodes for the N that ``budget``
    chooses (one of ``nested``'s prebuilt trees), and teaches the budget which of them were accepted and how long
    the step's forward took. The budget is shared, not copied: it learns across the runs of whoever holds it."""

    def __init__(self, matrix: AdjacencyMatrix, nested: NestedTrees, budget: TreeBudget,
                 seed_from_prompt: bool = False):
        if tuple(nested.sizes) != budget.sizes:
            raise ValueError(f"the budget's sizes {budget.sizes} are not the trees' {nested.sizes}")
        super().__init__(matrix, nested.trees[-1], seed_from_prompt)
        self.nested, self.budget = nested.to(matrix.rows.device), budget
        self._index = {n: i for i, n in enumerate(nested.sizes)}
        self._positions: tuple[int, ...] = ()
        self._timed = False  # whether the step verified the tree proposed (not a root cut near the context's end)

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]:
        i = self._index[self.budget.choose()]
        self.tree, self._positions = self.nested.trees[i], self.nested.positions[i]
        return self.matrix.retrieve(root, self.tree), self.tree

    def update(self, tokens: torch.Tensor, path: torch.Tensor, top: torch.Tensor | None,
               probs: torch.Tensor | None = None) -> list[RowUpdate]:
        rows = super().update(tokens, path, top, probs)
        self._timed = tokens.numel() == self.tree.size
        if self._timed:
            self.budget.observe_path([self._positions[i] for i in path.tolist()[1:]])
        return rows

    def observe(self, forward_ms: float) -> None:
        if self._timed:
            self.budget.observe_time(forward_ms)

    def budget_report(self) -> tuple[int | None, dict]:
        return self.tree.size - 1, self.budget.estimates()

"""Drafters: where the guessed tokens of a step come from. Every method shares one verification loop
(``decoding.decode``), which calls a drafter through two verbs only:

    draft = drafter.propose(context)      # a Draft: the tokens of a draft tree, node 0 the context's last token
    rows = drafter.learn(outcome)         # an Outcome: what verifying it showed; returns the matrix rows rewritten

What a drafter learns from is fixed when it is made (``Needs``: how many of each node's best next tokens, and
whether the prompt's too), and so is whatever it keeps (a matrix, a tree budget). Plain decoding proposes the root
alone; Prompt Lookup a chain copied from an earlier n-gram match; Token Recycling a tree retrieved from its adjacency
matrix, of a fixed template or, with a tree budget (``budget.TreeBudget``), of the N likeliest nodes for the N the
budget chooses each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol, Sequence

import torch

from .budget import TreeBudget
from .events import RowUpdate
from .matrix import AdjacencyMatrix
from .recycling import winners
from .tree import Path_, TreeBuffers, build_tree, chain_tree


@dataclass(frozen=True)
class Needs:
    """What a drafter learns from, so that the loop computes that and nothing more: ``top_k``, each verified node's
    k best next tokens (0: none); ``prefill``, the same for the prompt's tokens before the first step."""

    top_k: int = 0
    prefill: bool = False


@dataclass(frozen=True)
class Draft:
    """A proposal: ``tokens`` (n,) int64 on the context's device, ``tokens[0]`` the context's last token (the root,
    not yet in the KV cache), and their ``tree`` (n nodes, BFS order). A drafter with a tree budget says the draft
    nodes it chose (``budget``) and the estimates it chose from (``estimates``, ``TreeBudget.estimates``)."""

    tokens: torch.Tensor
    tree: TreeBuffers
    budget: int | None = None
    estimates: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OnHost:
    """What a step read to the host in its one read, on a backend whose tensors live on a device (the torch
    backend): the verified ``tokens``, the accepted ``path``'s node indices, each node's ``top`` k best next tokens
    (n lists; None for k = 0), and what the drafter asked to see (``peek``: its matrix rows of the tokens, before
    learning rewrites them), so that learning reads nothing more."""

    tokens: list[int]
    path: list[int]
    top: list[list[int]] | None
    peeked: list | None = None


@dataclass(frozen=True)
class Outcome:
    """What one verification showed, or (``path`` None) what the prompt's prefill predicted.

    ``tokens`` (n,): the nodes verified (the draft, or its part the loop had room for: ``whole`` says whether it was
    all of it), or the prompt's distinct tokens in sequence order; ``path`` (a + 1,): the accepted path's node
    indices, root first; ``top`` (n, k): each node's ``Needs.top_k`` best next tokens, best first (None for k = 0);
    ``logits`` (n, V): the model's next-token logits at each node, from which ``probs`` (n, k), the probabilities of
    ``top``, are computed on first use; ``forward_ms``: the forward pass, output layer and choice, in ms (None for the
    prompt)."""

    tokens: torch.Tensor
    path: torch.Tensor | None
    top: torch.Tensor | None
    logits: torch.Tensor | None = None
    forward_ms: float | None = None
    whole: bool = True
    host: OnHost | None = None  # the step's one read, where the loop made it (a device backend)

    @property
    def is_prompt(self) -> bool:
        return self.path is None

    @cached_property
    def probs(self) -> torch.Tensor | None:
        if self.top is None or self.logits is None:
            return None
        logits = self.logits.float()
        return (logits.gather(-1, self.top) - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()


class Drafter(Protocol):
    """What the decoding loop asks of a drafter (transformers' candidate generators have the same two verbs,
    ``get_candidates`` and ``update_candidate_strategy``): ``name`` (the method's name in events), ``needs``, and

    - ``propose(context)``: ``context`` (L,) int64, the sequence so far, its last token not yet in the KV cache ->
      a ``Draft``;
    - ``peek(tokens)``: on a device backend, what of its own device data ``learn`` will need (read with the step's
      one read into ``Outcome.host``), or None;
    - ``learn(outcome)``: the ``Outcome`` of the draft just proposed (once per step), or of the prompt (once, before
      the first step, where ``needs.prefill``) -> the adjacency-matrix rows it rewrote (empty: none).
    """

    name: str
    needs: Needs

    def propose(self, context: torch.Tensor) -> Draft: ...

    def peek(self, tokens: torch.Tensor) -> torch.Tensor | None: ...

    def learn(self, outcome: Outcome) -> list[RowUpdate]: ...


class PlainDrafter:
    """Plain greedy decoding: no draft, one token per forward pass."""

    name = "plain"
    needs = Needs()

    def propose(self, context: torch.Tensor) -> Draft:
        return Draft(context[-1:].clone(), chain_tree(0))

    def peek(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """What of the drafter's own device data ``learn`` will need, read with the step's one read (``OnHost``):
        none here."""
        return None

    def learn(self, outcome: Outcome) -> list[RowUpdate]:
        return []


class PromptLookupDrafter(PlainDrafter):
    """Prompt Lookup Decoding: find the latest earlier occurrence of the context's last n tokens (n from
    ``max_ngram`` down to ``min_ngram``) and propose the up to ``max_draft`` tokens that followed it, as a chain.

    >>> d = PromptLookupDrafter(max_ngram=2, max_draft=3)
    >>> d.propose(torch.tensor([5, 6, 7, 8, 9, 5, 6])).tokens.tolist()
    [6, 7, 8, 9]
    """

    name = "pld"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_draft: int = 10):
        if not 1 <= min_ngram <= max_ngram or max_draft < 1:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram and max_draft >= 1, got "
                             f"{min_ngram}, {max_ngram}, {max_draft}")
        self.max_ngram, self.min_ngram, self.max_draft = max_ngram, min_ngram, max_draft

    def propose(self, context: torch.Tensor) -> Draft:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if context.numel() <= n:
                continue
            # windows over context[:-1] start at 0 .. len-1-n: each match is followed by at least one token
            windows = context[:-1].unfold(0, n, 1)
            hits = (windows == context[-n:]).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n
                draft = context[start:start + self.max_draft]
                return Draft(torch.cat([context[-1:], draft]), chain_tree(draft.numel()))
        return super().propose(context)


class RecyclingDrafter(PlainDrafter):
    """Token Recycling (``recycling.py``): retrieve a draft tree from the adjacency matrix, then overwrite the rows of
    every tree token (accepted and rejected, root included) with the top-k of that node's output distribution; with
    ``seed_from_prompt``, first the rows of the prompt's tokens from the prefill's. ``needs.top_k`` is the matrix's
    k. A matrix that keeps probabilities gets them written beside the ids."""

    name = "tr"

    def __init__(self, matrix: AdjacencyMatrix, tree: TreeBuffers, seed_from_prompt: bool = False):
        if tree.max_rank >= matrix.k:
            raise ValueError(f"tree {tree.name!r} uses rank {tree.max_rank}, "
                             f"more than the matrix's k={matrix.k} allows")
        self.matrix, self.tree = matrix, tree  # the tree stays the host's; retrieval copies it once per device
        self.needs = Needs(top_k=matrix.k, prefill=seed_from_prompt)

    def propose(self, context: torch.Tensor) -> Draft:
        return Draft(self.matrix.retrieve(int(context[-1]), self.tree), self.tree)

    def learn(self, outcome: Outcome) -> list[RowUpdate]:
        """Overwrite the rows of the outcome's tokens with their ``top`` (and probabilities, in a matrix that keeps
        them); returns each distinct token's row change, in order of first occurrence (the prompt's: none)."""
        keeps = self.wants_probs or self.matrix.probs is not None
        if outcome.is_prompt:
            if self.needs.prefill:
                self.matrix.seed(outcome.tokens, outcome.top, outcome.probs if keeps else None)
            return []
        probs = outcome.probs if self.wants_probs else None
        if outcome.host is not None:  # everything from the step's one read: the matrix is not read back
            host = outcome.host
            tokens, k = host.tokens, self.matrix.k
            distinct = list(dict.fromkeys(tokens))  # in order of first occurrence
            first = {t: i for i, t in reversed(list(enumerate(tokens)))}
            old = ([list(host.peeked[first[t]]) for t in distinct] if host.peeked is not None
                   else self.matrix.rows_of(distinct))
            self.matrix.update(outcome.tokens, outcome.top, priority=host.path, probs=probs, token_list=tokens)
            win = winners(tokens, host.path)
            return [RowUpdate(t, o, host.top[win[t]][:k]) for t, o in zip(distinct, old)]
        tokens = outcome.tokens.tolist()
        distinct = list(dict.fromkeys(tokens))  # in order of first occurrence
        old = self.matrix.rows_of(distinct)
        self.matrix.update(outcome.tokens, outcome.top, priority=outcome.path, probs=probs, token_list=tokens)
        new = self.matrix.rows_of(distinct)
        return list(map(RowUpdate, distinct, old, new))

    def peek(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The matrix rows of the step's tokens before ``learn`` rewrites them (the event's "before"), where the
        matrix is on a device; on the host ``learn`` reads them itself, for free."""
        return None if self.matrix.on_host() else self.matrix.rows[tokens.to(self.matrix.rows.device)]

    # whether the rows rewritten get their probabilities (the methods that read them; the matrix keeps them from the
    # first such write on); the others mark them unknown in a matrix that keeps them
    wants_probs = False


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
        self.nested, self.budget = nested, budget
        self._index = {n: i for i, n in enumerate(nested.sizes)}
        self._positions: tuple[int, ...] = ()

    def propose(self, context: torch.Tensor) -> Draft:
        i = self._index[self.budget.choose()]
        self.tree, self._positions = self.nested.trees[i], self.nested.positions[i]
        return Draft(self.matrix.retrieve(int(context[-1]), self.tree), self.tree, self.tree.size - 1,
                     self.budget.estimates())

    def learn(self, outcome: Outcome) -> list[RowUpdate]:
        """Rewrite the rows (``RecyclingDrafter.learn``); where the whole tree was verified (not a root cut near the
        context's end), teach the budget which of its nodes were accepted and how long the step took."""
        rows = super().learn(outcome)
        if not outcome.is_prompt and outcome.whole:
            path = outcome.host.path if outcome.host is not None else outcome.path.tolist()
            self.budget.observe_path([self._positions[i] for i in path[1:]])
            self.budget.observe_time(outcome.forward_ms)
        return rows

"""Drafters: where the guessed tokens of a step come from. All three share one verification engine
(``decoding.decode``), which calls them only through the ``Drafter`` protocol below.

Plain decoding proposes the root alone; Prompt Lookup a chain copied from an earlier n-gram match; Token Recycling
a tree retrieved from its adjacency matrix.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .events import RowUpdate
from .matrix import AdjacencyMatrix
from .tree import TreeBuffers, chain_tree


class Drafter(Protocol):
    """What the decoding loop asks of a drafter, as in transformers' candidate generators (``get_candidates``,
    ``update_candidate_strategy``), plus a hook for the prompt.

    Each step the loop calls ``propose``, verifies the draft in one forward pass, then calls ``update`` once, always
    as ``update(tokens, path, top)``. ``n`` is the tree's node count, ``V`` the vocabulary size.

    - ``name``: the method's name in events ("plain", "pld", "tr").
    - ``top_k``: how many of each node's best next tokens ``update`` wants (0: none; ``top`` is then None).
    - ``wants_prefill_logits``: whether the loop should compute the prompt's logits for ``on_prefill``.
    - ``propose(context, root)``: ``context`` (L,) int64, the sequence so far, its last token ``root`` not yet in
      the KV cache -> ``(tokens, tree)``: ``tokens`` (n,) int64 with ``tokens[0] == root``, on the context's device,
      and the draft tree of ``n`` nodes in BFS order.
    - ``update(tokens, path, top)``: learn from the verified step. ``tokens`` (n,) as proposed; ``path`` (a + 1,)
      int64, the accepted path's node indices, root first; ``top`` (n, top_k) int64, each node's best next tokens,
      best first (None when ``top_k`` is 0). Returns the adjacency-matrix rows it rewrote (empty: none).
    - ``on_prefill(ids, logits)``: called only when ``wants_prefill_logits``, in chunks, with ``ids`` (m,) distinct
      prompt tokens in sequence order and ``logits`` (m, V), the next-token logits at each one's last occurrence.
    """

    name: str
    top_k: int
    wants_prefill_logits: bool

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]: ...

    def update(self, tokens: torch.Tensor, path: torch.Tensor, top: torch.Tensor | None) -> list[RowUpdate]: ...

    def on_prefill(self, ids: torch.Tensor, logits: torch.Tensor) -> None: ...


class PlainDrafter:
    """Plain greedy decoding: no draft, one token per forward pass."""

    name = "plain"
    wants_prefill_logits = False
    top_k = 0

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]:
        return context[-1:].clone(), chain_tree(0)

    def update(self, tokens: torch.Tensor, path: torch.Tensor, top: torch.Tensor | None) -> list[RowUpdate]:
        return []

    def on_prefill(self, ids: torch.Tensor, logits: torch.Tensor) -> None:
        pass


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
            raise ValueError(f"tree {tree.name!r} uses rank {tree.max_rank}, more than the matrix's k={matrix.k} allows")
        self.matrix, self.tree, self.seed_from_prompt = matrix, tree.to(matrix.rows.device), seed_from_prompt
        self.wants_prefill_logits = seed_from_prompt
        self.top_k = matrix.k

    def propose(self, context: torch.Tensor, root: int) -> tuple[torch.Tensor, TreeBuffers]:
        return self.matrix.retrieve(root, self.tree), self.tree

    def update(self, tokens: torch.Tensor, path: torch.Tensor, top: torch.Tensor | None) -> list[RowUpdate]:
        """Overwrite the rows of the tree's tokens with ``top`` (n, k); returns each distinct token's row change, in
        order of first occurrence."""
        distinct = list(dict.fromkeys(tokens.tolist()))  # in order of first occurrence
        index = torch.tensor(distinct, dtype=torch.long, device=tokens.device)
        old = self.matrix.rows[index].tolist()
        self.matrix.update(tokens, top, priority=path)
        new = self.matrix.rows[index].tolist()
        return [RowUpdate(t, o, n) for t, o, n in zip(distinct, old, new)]

    def on_prefill(self, ids: torch.Tensor, logits: torch.Tensor) -> None:
        if self.seed_from_prompt:
            self.matrix.seed(ids, logits)


"""The adjacency matrix M (|V| x k, int32): for every token, the top-k next tokens predicted after it most recently.

Retrieval grows a draft tree from M by BFS over a template, one gather per depth level. Updating overwrites the
rows of every tree token with the top-k of that node's new output distribution. Fresh matrices are all zeros
(cold start); a saved matrix can be loaded to start hot.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .tree import TreeBuffers


class AdjacencyMatrix:
    """``rows`` is a ``(vocab_size, k)`` int32 tensor; ``rows[t, r]`` is the rank-``r`` candidate after token ``t``."""

    def __init__(self, vocab_size: int, k: int = 8, device: torch.device | str = "cpu"):
        if vocab_size < 1 or k < 1:
            raise ValueError(f"adjacency matrix needs vocab_size >= 1 and k >= 1, got {vocab_size} x {k}")
        self.rows = torch.zeros(vocab_size, k, dtype=torch.int32, device=device)

    @property
    def vocab_size(self) -> int:
        return self.rows.shape[0]

    @property
    def k(self) -> int:
        return self.rows.shape[1]

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def clone(self) -> "AdjacencyMatrix":
        m = AdjacencyMatrix.__new__(AdjacencyMatrix)
        m.rows = self.rows.clone()
        return m

    def retrieve(self, root: int, tree: TreeBuffers) -> torch.Tensor:
        """Draft tokens for every node of ``tree`` (BFS order, ``tokens[0] = root``), shape ``(tree.size,)`` int64.

        Node ``i`` at depth ``d`` gets ``rows[tokens[parent[i]], rank[i]]``: one gather per depth level.
        """
        if tree.max_rank >= self.k:
            raise ValueError(f"tree {tree.name!r} uses rank {tree.max_rank} but the matrix keeps only k={self.k}")
        tokens = torch.empty(tree.size, dtype=torch.long, device=self.rows.device)
        tokens[0] = root
        flat = self.rows.view(-1)
        for start, stop in tree.levels:
            parent_tokens = tokens[tree.parents[start:stop]]
            tokens[start:stop] = flat[parent_tokens * self.k + tree.ranks[start:stop]]
        return tokens

    def update(self, tokens: torch.Tensor, top: torch.Tensor, priority: torch.Tensor | None = None) -> torch.Tensor:
        """Overwrite the rows of ``tokens`` (n,) with ``top`` (n, >= k), each node's best next tokens, best first (the
        decoding step takes them with its greedy choice, so the matrix needs no second pass over the vocabulary);
        returns the new rows (n, k).

        A token that occurs at several nodes gets the row of its last occurrence; nodes listed in ``priority``
        (the accepted path) are written last, so a token on the accepted path keeps the row from its real context.
        """
        if top.shape[-1] < self.k:
            raise ValueError(f"the matrix keeps k={self.k} candidates per row, got {top.shape[-1]}")
        new_rows = top[:, :self.k].to(torch.int32)
        if priority is None:
            self.rows[tokens] = new_rows
        else:
            order = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
            order[priority] = False
            rest = order.nonzero().flatten()
            self.rows[tokens[rest]] = new_rows[rest]
            self.rows[tokens[priority]] = new_rows[priority]
        return new_rows

    def seed(self, token_ids: torch.Tensor, logits: torch.Tensor) -> None:
        """Fill rows from a prompt's prefill logits: ``token_ids`` (n,), ``logits`` (n, V), in sequence order."""
        self.rows[token_ids] = torch.topk(logits, self.k, dim=-1).indices.to(torch.int32)

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> None:
        meta = {"vocab_size": str(self.vocab_size), "k": str(self.k), **(metadata or {})}
        save_file({"rows": self.rows.cpu().contiguous()}, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None, k: int | None = None,
             device: torch.device | str = "cpu") -> "AdjacencyMatrix":
        """Load a saved matrix. A smaller ``k`` than saved keeps the top ranks; a vocabulary mismatch or a larger
        ``k`` raises a clear error."""
        try:
            rows = load_file(str(path))["rows"]
        except Exception as e:  # OSError, KeyError, or safetensors' own error types
            raise ValueError(f"cannot load adjacency matrix from {path}: {e}") from None
        if rows.dtype != torch.int32 or rows.dim() != 2:
            raise ValueError(f"{path}: expected a 2-D int32 'rows' tensor, got {rows.dtype} {tuple(rows.shape)}")
        if vocab_size is not None and rows.shape[0] != vocab_size:
            raise ValueError(f"{path}: matrix is for a vocabulary of {rows.shape[0]}, the model has {vocab_size}")
        if k is not None and k > rows.shape[1]:
            raise ValueError(f"{path}: matrix keeps k={rows.shape[1]} candidates, k={k} was asked for")
        if k is not None:
            rows = rows[:, :k].contiguous()  # the top-k of a distribution is a prefix of its top-k' for k' > k
        m = cls.__new__(cls)
        m.rows = rows.to(device)
        return m

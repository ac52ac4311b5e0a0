"""The adjacency matrix M (|V| x k, int32): for every token, the top-k next tokens predicted after it most recently.

Its storage and bookkeeping: the paper's retrieval and update themselves are ``recycling.retrieve`` and
``recycling.update`` (read ``recycling.py`` first). Fresh matrices are all zeros (cold start); a saved matrix can be
loaded to start hot (``save``, ``load``); a request's change is a ``MatrixDelta``.

A matrix may also keep, beside each row's k ids, their k probabilities (``probs``, float16), from which the
dynamic drafter (``dynamic.py``) grows its tree best-first. The paper's method never needs them. A row's
probabilities are known (written with its ids), 0 (a row never written: all ids 0), or unknown (NaN: ids written
without probabilities, e.g. a hot-start file saved without them); an unknown row reads as the per-rank prior
(``prior()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from . import recycling
from .tree import TreeBuffers

# How many rows the default prior counts for in the running mean of probabilities: one, so real rows soon outweigh it
PRIOR_WEIGHT = 1.0


def default_prior(k: int) -> list[float]:
    """The prior of a row whose probabilities are unknown, before any were written: rank r gets 2^-(r+1), halving
    per rank as the top of a peaked next-token distribution does. ``[0.5, 0.25, 0.125]`` for k = 3."""
    return [0.5 ** (r + 1) for r in range(k)]


@dataclass(frozen=True)
class MatrixDelta:
    """What a matrix changed over a base matrix: the rows that differ (``index``, their ids ``rows`` and, for a
    matrix that keeps them, their probabilities ``probs``) and its running mean of probabilities. A few dozen KB
    for a run's rewritten rows, against the whole matrix's 1.5 MB (``AdjacencyMatrix.delta_from``, ``applied_to``)."""

    index: np.ndarray  # (n,) int64, ascending
    rows: np.ndarray  # (n, k) int32
    probs: np.ndarray | None  # (n, k) float16, or None where the matrix keeps no probabilities
    prob_sums: tuple[float, ...]
    prob_count: int

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self.rows.nbytes + (0 if self.probs is None else self.probs.nbytes)

    def applied_to(self, base: "AdjacencyMatrix") -> "AdjacencyMatrix":
        """A new matrix: ``base`` (left as it is) with these rows written over it.

        >>> base, m = AdjacencyMatrix(6, k=2), AdjacencyMatrix(6, k=2)
        >>> _ = m.update(torch.tensor([3]), torch.tensor([[4, 5]]))
        >>> delta = m.delta_from(base)
        >>> delta.index.tolist(), torch.equal(delta.applied_to(base).rows, m.rows), int(base.rows.sum())
        ([3], True, 0)
        """
        m = base.clone()
        index = torch.from_numpy(self.index).to(m.rows.device)
        if self.probs is not None:
            m.with_probs()
            m.probs[index] = torch.from_numpy(self.probs).to(m.probs.device)
        m.rows[index] = torch.from_numpy(self.rows).to(m.rows.device)
        m.prob_sums, m.prob_count = list(self.prob_sums), self.prob_count
        return m


class AdjacencyMatrix:
    """``rows`` is a ``(vocab_size, k)`` int32 tensor; ``rows[t, r]`` is the rank-``r`` candidate after token ``t``.

    ``probs`` is None, or (with ``keep_probs`` or ``with_probs()``) a ``(vocab_size, k)`` float16 tensor:
    ``probs[t, r]`` is the model's probability of ``rows[t, r]`` after ``t`` when that row was written. A running
    mean of every probability row written (``prob_sums / prob_count`` per rank, ``default_prior`` counted as
    ``PRIOR_WEIGHT`` rows) stands in for rows whose probabilities are unknown.
    """

    def __init__(self, vocab_size: int, k: int = 8, device: torch.device | str = "cpu", keep_probs: bool = False):
        if vocab_size < 1 or k < 1:
            raise ValueError(f"adjacency matrix needs vocab_size >= 1 and k >= 1, got {vocab_size} x {k}")
        self.rows = torch.zeros(vocab_size, k, dtype=torch.int32, device=device)
        self.probs: torch.Tensor | None = None
        self.prob_sums, self.prob_count = [0.0] * k, 0
        if keep_probs:
            self.with_probs()

    @property
    def vocab_size(self) -> int:
        return self.rows.shape[0]

    @property
    def k(self) -> int:
        return self.rows.shape[1]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.probs is None else self.probs.numel() * self.probs.element_size()
        return self.rows.numel() * self.rows.element_size() + extra

    @property
    def device(self) -> torch.device:
        return self.rows.device

    def clone(self, device: torch.device | str | None = None) -> "AdjacencyMatrix":
        """A copy, on ``device`` (None: this matrix's)."""
        m = AdjacencyMatrix.__new__(AdjacencyMatrix)
        m.rows = self.rows.to(device, copy=True)
        m.probs = None if self.probs is None else self.probs.to(device, copy=True)
        m.prob_sums, m.prob_count = list(self.prob_sums), self.prob_count
        return m

    def to(self, device: torch.device | str) -> "AdjacencyMatrix":
        """This matrix on ``device``: itself where it is there already, else a copy there (the model's device, so
        that drafting and learning never cross devices).

        >>> m = AdjacencyMatrix(4, k=2)
        >>> m.to("cpu") is m, m.to("meta").device.type
        (True, 'meta')
        """
        return self if self.is_on(device) else self.clone(device)

    def is_on(self, device: torch.device | str) -> bool:
        """Whether the matrix is on ``device`` ("cuda" meaning the current CUDA device)."""
        target = torch.device(device)
        return self.device.type == target.type and target.index in (None, self.device.index)

    def delta_from(self, base: "AdjacencyMatrix") -> MatrixDelta:
        """The rows of this matrix that differ from ``base``'s, ids or probabilities, on the CPU whatever device
        either is on: with ``delta.applied_to(base)`` they give this matrix back."""
        a, b = self.rows.cpu().numpy(), base.rows.cpu().numpy()
        changed = (a != b).any(axis=1)
        probs = None
        if self.probs is not None:
            probs = self.probs.cpu().numpy()
            if base.probs is not None:
                theirs = base.probs.cpu().numpy()
            else:  # what base.with_probs() would hold: unknown where written, 0 elsewhere
                theirs = np.where(b.any(axis=1, keepdims=True), np.float16("nan"), np.float16(0)).astype(np.float16)
            same = (probs == theirs) | (np.isnan(probs) & np.isnan(theirs))
            changed |= ~same.all(axis=1)
        index = np.flatnonzero(changed)
        return MatrixDelta(index, a[index].copy(), None if probs is None else probs[index].copy(),
                           tuple(self.prob_sums), self.prob_count)

    def with_probs(self) -> "AdjacencyMatrix":
        """Keep probabilities from now on (in place; returns the matrix). Rows already written get unknown
        probabilities, rows never written (all ids 0) get 0. A matrix that keeps them already is left as it is."""
        if self.probs is None:
            written = self.rows.ne(0).any(dim=1, keepdim=True).expand(-1, self.k)
            self.probs = torch.zeros(self.rows.shape, dtype=torch.float16, device=self.rows.device)
            self.probs[written] = float("nan")
            self.prob_sums, self.prob_count = [0.0] * self.k, 0
        return self

    def prior(self) -> list[float]:
        """The probability per rank that a row of unknown probabilities reads as: the running mean of every
        probability row written to this matrix (``update``, ``seed``, or known rows of a loaded file), with
        ``default_prior(k)`` counted as ``PRIOR_WEIGHT`` rows.

        >>> m = AdjacencyMatrix(4, k=2, keep_probs=True)
        >>> m.prior()
        [0.5, 0.25]
        >>> _ = m.update(torch.tensor([1]), torch.tensor([[2, 3]]), probs=torch.tensor([[0.9, 0.05]]))
        >>> [round(p, 3) for p in m.prior()]
        [0.7, 0.15]
        """
        w, n = PRIOR_WEIGHT, self.prob_count
        return [(s + w * d) / (n + w) for s, d in zip(self.prob_sums, default_prior(self.k))]

    def _count(self, probs: torch.Tensor) -> None:
        self.prob_sums = [s + p for s, p in zip(self.prob_sums, probs.double().sum(dim=0).tolist())]
        self.prob_count += probs.shape[0]

    def retrieve(self, root: int, tree: TreeBuffers) -> torch.Tensor:
        """Draft tokens for every node of ``tree`` (BFS order, ``tokens[0] = root``), shape ``(tree.size,)`` int64:
        the paper's retrieval, ``recycling.retrieve``."""
        if tree.max_rank >= self.k:
            raise ValueError(f"tree {tree.name!r} uses rank {tree.max_rank} but the matrix keeps only k={self.k}")
        return recycling.retrieve(self.rows, root, tree, self.on_host())

    def on_host(self) -> bool:
        """Whether the matrix is in the host's memory (numpy reads it for free); elsewhere (a GPU) it is read and
        written with tensor operations only, never read back but on purpose (``rows_of``)."""
        return self.rows.device.type == "cpu"

    def rows_of(self, ids: list[int]) -> list[list[int]]:
        """The rows of ``ids``, as Python lists (on a GPU: a read that waits for the device)."""
        if self.on_host():
            return self.rows.numpy()[ids].tolist()
        return self.rows[torch.tensor(ids, device=self.rows.device)].tolist()

    def update(self, tokens: torch.Tensor, top: torch.Tensor, priority: torch.Tensor | None = None,
               probs: torch.Tensor | None = None, token_list: list[int] | None = None) -> torch.Tensor:
        """Overwrite the rows of ``tokens`` (n,) with ``top`` (n, >= k), each node's best next tokens, best first (the
        decoding step takes them with its greedy choice, so the matrix needs no second pass over the vocabulary);
        returns the new rows (n, k).

        A token that occurs at several nodes gets the row of its last occurrence; nodes listed in ``priority``
        (the accepted path) are written last, so a token on the accepted path keeps the row from its real context.

        ``probs`` (n, >= k), the probabilities of ``top``, are written beside the ids by the same rule, into a matrix
        that keeps probabilities; without them such a matrix marks the rewritten rows' probabilities unknown.
        ``token_list``: ``tokens.tolist()``, where the caller has it already; ``priority`` may be a list too.
        """
        if top.shape[-1] < self.k:
            raise ValueError(f"the matrix keeps k={self.k} candidates per row, got {top.shape[-1]}")
        if probs is not None and self.probs is None:
            self.with_probs()  # from now on it keeps them: the rows written so far, unknown
        if probs is not None and (probs.shape[0] != top.shape[0] or probs.shape[-1] < self.k):
            raise ValueError(f"probs {tuple(probs.shape)} do not match top {tuple(top.shape)} for k={self.k}")
        new_rows = top[:, :self.k].to(torch.int32)
        if self.probs is None:
            new_probs = None
        elif probs is None:
            new_probs = torch.full(new_rows.shape, float("nan"), dtype=torch.float16, device=self.rows.device)
        else:
            new_probs = probs[:, :self.k].to(torch.float16)
            self._count(probs[:, :self.k])
        toks = tokens.tolist() if token_list is None else token_list
        ids, nodes = recycling.update(self.rows, toks, new_rows,
                                      priority.tolist() if isinstance(priority, torch.Tensor) else priority,
                                      self.on_host())
        if new_probs is not None:  # beside the ids (the methods beyond the paper read them), by the same rule
            recycling.write_rows(self.probs, ids, new_probs, nodes, self.on_host())
        return new_rows

    def seed(self, token_ids: torch.Tensor, top: torch.Tensor, probs: torch.Tensor | None = None) -> None:
        """Fill rows from a prompt's prefill: ``token_ids`` (n,) distinct, ``top`` (n, >= k) each one's best next
        tokens; into a matrix that keeps probabilities, with ``probs`` (n, >= k), the probabilities of ``top``."""
        if probs is not None and self.probs is None:
            self.with_probs()  # from now on it keeps them: the rows written so far, unknown
        self.rows[token_ids] = top[:, :self.k].to(torch.int32)
        if self.probs is not None:
            if probs is None:
                raise ValueError("this matrix keeps probabilities: seed it with them")
            self.probs[token_ids] = probs[:, :self.k].to(torch.float16)
            self._count(probs[:, :self.k])

    def save(self, path: str | Path, metadata: dict[str, str] | None = None) -> None:
        """Save ``rows`` (and ``probs``, when kept, as a second tensor) to a safetensors file."""
        meta = {"vocab_size": str(self.vocab_size), "k": str(self.k), **(metadata or {})}
        tensors = {"rows": self.rows.cpu().contiguous()}
        if self.probs is not None:
            tensors["probs"] = self.probs.cpu().contiguous()
        save_file(tensors, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | Path, vocab_size: int | None = None, k: int | None = None,
             device: torch.device | str = "cpu") -> "AdjacencyMatrix":
        """Load a saved matrix. A smaller ``k`` than saved keeps the top ranks; a vocabulary mismatch or a larger
        ``k`` raises a clear error. A file with probabilities gives a matrix that keeps them, its prior started from
        the file's known rows; a file without them, one that keeps none (``with_probs()`` turns them on, unknown)."""
        try:
            tensors = load_file(str(path))
            rows = tensors["rows"]
        except Exception as e:  # OSError, KeyError, or safetensors' own error types
            raise ValueError(f"cannot load adjacency matrix from {path}: {e}") from None
        if rows.dtype != torch.int32 or rows.dim() != 2:
            raise ValueError(f"{path}: expected a 2-D int32 'rows' tensor, got {rows.dtype} {tuple(rows.shape)}")
        probs = tensors.get("probs")
        if probs is not None and (probs.dtype != torch.float16 or probs.shape != rows.shape):
            raise ValueError(f"{path}: expected float16 'probs' of shape {tuple(rows.shape)}, got {probs.dtype} "
                             f"{tuple(probs.shape)}")
        if vocab_size is not None and rows.shape[0] != vocab_size:
            raise ValueError(f"{path}: matrix is for a vocabulary of {rows.shape[0]}, the model has {vocab_size}")
        if k is not None and k > rows.shape[1]:
            raise ValueError(f"{path}: matrix keeps k={rows.shape[1]} candidates, k={k} was asked for")
        if k is not None:
            rows = rows[:, :k].contiguous()  # the top-k of a distribution is a prefix of its top-k' for k' > k
            probs = None if probs is None else probs[:, :k].contiguous()
        m = cls.__new__(cls)
        m.rows, m.probs = rows.to(device), None if probs is None else probs.to(device)
        m.prob_sums, m.prob_count = [0.0] * m.k, 0
        if probs is not None:
            known = rows.ne(0).any(dim=1) & ~probs.isnan().any(dim=1)
            m._count(probs[known])
        return m

"""The choice over the vocabulary: a row's k best token ids, and its greedy choice exactly as ``argmax`` makes it.
A leaf module (torch only): the decoding loop, the drafters and the calibration all read it."""

from __future__ import annotations

import torch

CHUNK = 64  # top_k: ids per chunk of the first pass
DIRECT = 4096  # top_k: rows this long or shorter go straight to torch.topk
# a faster top_k where a backend has one (``use``): native.c's ``tr_top_k``, registered when its library loads
_FASTER: list = []


def use(faster) -> None:
    """Let ``top_k`` ask ``faster(logits, k)`` first: ``(values, ids)`` with ``top_k``'s promise (the same values,
    best first; among equal values any of their ids), or None where it declines (then torch's ops run)."""
    _FASTER[:] = [faster]


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, k, dim=-1)`` for rows (n, V) over a large vocabulary, in a fraction of its time on CPU:
    the same values, best first; among equal values the ids may be other equal-valued ids.

    The ids are split into chunks of ``CHUNK`` consecutive ids, and only the ``k`` chunks with the largest maxima are
    searched (plus the last ``V % CHUNK`` ids). Every value above the k-th largest ``v`` is found: a chunk holding
    one has a maximum above ``v``, and fewer than ``k`` chunks do, so it is among the ``k`` taken; and the ``k``
    chunks taken hold ``k`` distinct values of at least ``v`` (their maxima). One pass over the logits (the chunks'
    maxima) instead of topk's partial sort of every row. Where a backend registered a faster one (``use``), it is
    asked first, for these rows only (shorter ones keep torch.topk's own order among equal values).

    >>> values, ids = top_k(torch.arange(50000.).flip(0)[None], 3)
    >>> values, ids
    (tensor([[49999., 49998., 49997.]]), tensor([[0, 1, 2]]))
    """
    n, vocab = logits.shape
    m = vocab // CHUNK
    if vocab <= DIRECT or k > m or logits.stride(-1) != 1:
        return torch.topk(logits, k, dim=-1)
    if _FASTER:
        got = _FASTER[0](logits, k)
        if got is not None:
            return torch.return_types.topk(got)
    maxima = logits[:, :m * CHUNK].view(n, m, CHUNK).amax(dim=-1)  # (n, m): chunk c's maximum
    chunks = top_k(maxima, k).indices  # (n, k), recursively for a very large vocabulary
    ids = (chunks[:, :, None] * CHUNK + torch.arange(CHUNK, device=logits.device)).view(n, k * CHUNK)
    if vocab % CHUNK:
        ids = torch.cat([ids, torch.arange(m * CHUNK, vocab, device=logits.device).expand(n, -1)], dim=1)
    values, picked = torch.topk(logits.gather(1, ids), k, dim=-1)
    return torch.return_types.topk((values, ids.gather(1, picked)))


def greedy_and_top_k(logits: torch.Tensor, k: int, no_read: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The greedy choice of every row, exactly as ``argmax`` makes it, and the row's ``k`` best token ids (n, k),
    best first, from one ``topk`` (None for ``k`` = 0). A drafter that learns from every node's top-k so needs no
    second pass over the vocabulary for the greedy choice.

    ``argmax`` takes the lowest id among equal maxima, while ``topk`` promises no order among equal values, so rows
    whose two best logits are equal take their greedy choice from ``argmax``. ``no_read``: never look at the
    values on the host (a device where a read waits for the device): every row's ``argmax`` is taken, and used where
    its two best tie.
    """
    if k < 2:
        predicted = logits.argmax(dim=-1)
        return predicted, (predicted[:, None] if k == 1 else None)
    values, top = top_k(logits, k)
    predicted = top[:, 0].clone()
    ties = values[:, 0] == values[:, 1]
    if no_read:
        return torch.where(ties, logits.argmax(dim=-1), predicted), top
    if bool(ties.any()):
        predicted[ties] = logits[ties].argmax(dim=-1)
    return predicted, top

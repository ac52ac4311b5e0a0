"""Sampling that stays exact: every method makes the same choice as plain sampling, token for token.

The randomness of the token at absolute position ``p`` of the sequence comes from ``(seed, p)`` alone: Gumbel
noise ``g_p`` over the vocabulary. The token chosen there is ``argmax(processed logits + g_p)``, where the processed
logits are ``logits / temperature`` with the tokens outside the top-k filter and the top-p set at ``-inf``. By the
Gumbel-max trick that argmax is an exact sample of the processed distribution (softmax of the processed logits).

Verification then applies the greedy rule to the perturbed logits: a draft child is accepted exactly when its token
is the choice at its parent. The choice at a position depends only on the prefix (through the logits) and on
``(seed, position)``, so plain decoding, Prompt Lookup and Token Recycling choose the same token at every position,
and each emitted token is an exact sample given its prefix. The chance of going deeper at a node is the processed
probability mass of its draft children: the most any lossless rule gets from deterministic drafts.

Names: ``sample_top_k`` is the sampling filter (keep the k likeliest tokens); the adjacency matrix's ``top_k``
(``EngineConfig.top_k``) is how many candidates each matrix row keeps, and the matrix keeps learning from the raw
logits whatever the sampling.

    >>> s = Sampling(temperature=0.7, top_p=0.9, sample_top_k=50, seed=3)
    >>> s.describe(), Sampling().describe(), Sampling().is_greedy
    ('sampled: T=0.7, top-p 0.9, top-k 50, seed 3', 'greedy', True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_MASK = (1 << 64) - 1
_TOP_P_WINDOW = 128  # the top-p set is looked for among this many likeliest tokens first


def _mix(seed: int, position: int) -> int:
    """A 64-bit hash of ``(seed, position)`` (splitmix64's finalizer): the noise generator's seed."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + 1) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def gumbel(seed: int, position: int, vocab: int) -> torch.Tensor:
    """The Gumbel noise (vocab,) float64 of ``position`` under ``seed``: drawn on the CPU from a generator seeded by
    their hash, so the same on every device and in every batch.

    >>> torch.equal(gumbel(3, 17, 5), gumbel(3, 17, 5)), torch.equal(gumbel(3, 17, 5), gumbel(3, 18, 5))
    (True, False)
    """
    u = torch.rand(vocab, generator=torch.Generator().manual_seed(_mix(seed, position)), dtype=torch.float64)
    return -torch.log(-torch.log(u.clamp_(min=torch.finfo(torch.float64).tiny)))


@dataclass(frozen=True)
class Sampling:
    """How each token is chosen. ``temperature`` 0 is greedy (the default; the other fields are then unused);
    above 0, a sample of softmax(logits / temperature) restricted to the ``sample_top_k`` likeliest tokens (0: no
    such filter) and then to the top-p set (the fewest likeliest tokens whose probability reaches ``top_p``; 1: all),
    its randomness drawn from ``seed`` and the token's position."""

    temperature: float = 0.0
    top_p: float = 1.0
    sample_top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 = no top-p filter), got {self.top_p!r}")
        if isinstance(self.sample_top_k, bool) or not isinstance(self.sample_top_k, int) or self.sample_top_k < 0:
            raise ValueError(f"sample_top_k must be an integer >= 0 (0 = no top-k filter), got {self.sample_top_k!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        """How a step chose, for events and people: "greedy", or "sampled: T=..., top-p ..., top-k ..., seed ..."
        (a filter that changes nothing left out)."""
        if self.is_greedy:
            return "greedy"
        parts = [f"T={self.temperature:g}"] + ([f"top-p {self.top_p:g}"] if self.top_p < 1 else []) + (
            [f"top-k {self.sample_top_k}"] if self.sample_top_k else []) + [f"seed {self.seed}"]
        return "sampled: " + ", ".join(parts)

    def processed(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits (n, V) of ``logits`` (n, V): divided by the temperature, the tokens outside the
        top-k filter, then outside the top-p set of what is left, at -inf. Float64 logits stay float64, others
        become float32. Each row depends on that row alone. Ties at a filter's edge are all kept.

        >>> Sampling(1.0, top_p=0.6).processed(torch.log(torch.tensor([[0.5, 0.3, 0.2]]))).isfinite().tolist()
        [[True, True, False]]
        """
        if self.is_greedy:
            raise ValueError("greedy decoding has no processed distribution: the temperature is 0")
        z = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32) / self.temperature
        k = self.sample_top_k if 0 < self.sample_top_k < z.shape[-1] else 0
        if k:
            values = torch.topk(z, k, dim=-1).values  # (n, k), descending: the kept set, but for ties at the k-th
            threshold = values[:, -1:]
            if self.top_p < 1:
                # the filtered distribution's total, with the tokens tied with the k-th beyond the k counted in
                ties = (z >= threshold).sum(dim=-1, keepdim=True) - k
                log_total = torch.logaddexp(torch.logsumexp(values, dim=-1, keepdim=True), threshold + ties.log())
                threshold, _ = _top_p_cut(values, log_total, self.top_p)  # not reached: the tie group, the k-th
        elif self.top_p < 1:
            threshold = _top_p_threshold(z, self.top_p)
        else:
            return z
        return z.masked_fill(z < threshold, -math.inf)

    def choose(self, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The token (n,) chosen in each row of ``logits`` (n, V), the next-token logits for the tokens at the
        absolute ``positions`` (n,) (without a cache of noise: see ``Sampler``)."""
        return Sampler(self).choose(logits, positions)


def _top_p_cut(values: torch.Tensor, log_total: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Given each row's likeliest logits ``values`` (n, w), descending, and the row's log total ``log_total``
    (n, 1): the logit (n, 1) of the first token at which the cumulative probability reaches ``top_p`` (the last
    one where it does not), and whether it did (n,)."""
    reached = (values - log_total).exp().cumsum(dim=-1) >= top_p
    found = reached.any(dim=-1)
    first = torch.where(found, reached.int().argmax(dim=-1), values.shape[-1] - 1)
    return values.gather(-1, first[:, None]), found


def _top_p_threshold(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per row of ``z`` (n, V), the smallest logit (n, 1) of the top-p set: the fewest likeliest tokens whose
    probability reaches ``top_p`` (with every token tied with the last of them). Looked for among the row's 128
    likeliest tokens first; a row whose set is larger sorts only its tokens of probability >= (1 - top_p) / V
    (together they hold more than ``top_p``, so the set is among them): a full sort costs ~3.5 ms a row at V = 49k,
    a top-128 ~0.25 ms. Each row's result depends on its own values only."""
    n, vocab = z.shape
    log_total = torch.logsumexp(z, dim=-1, keepdim=True)
    threshold, found = _top_p_cut(torch.topk(z, min(_TOP_P_WINDOW, vocab), dim=-1).values, log_total, top_p)
    floor = log_total + math.log((1 - top_p) / vocab)
    for row in (~found).nonzero().flatten().tolist():
        candidates = z[row][z[row] >= floor[row]].sort(descending=True).values
        threshold[row] = _top_p_cut(candidates[None], log_total[row:row + 1], top_p)[0][0]
    return threshold


class Sampler:
    """One decoding run's choices under ``sampling``: the Gumbel noise of each position is drawn once and kept (a
    tree's nodes at one depth share their next position, and a step's rejected positions come again in the next
    step); positions before the latest one asked for are forgotten."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self._noise: dict[int, torch.Tensor] = {}

    def noise(self, position: int, vocab: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``gumbel(seed, position, vocab)`` in ``dtype`` on ``device``, kept for the next steps."""
        if position not in self._noise:
            self._noise[position] = gumbel(self.sampling.seed, position, vocab).to(device=device, dtype=dtype)
        return self._noise[position]

    def choose(self, logits: torch.Tensor, positions: torch.Tensor,
               processed: torch.Tensor | None = None) -> torch.Tensor:
        """The token (n,) int64 chosen in each row of ``logits`` (n, V), whose next token is at ``positions`` (n,):
        argmax (greedy), or argmax of the processed logits (``processed``, if already computed) plus the
        position's Gumbel noise."""
        if self.sampling.is_greedy:
            return logits.argmax(dim=-1)
        z = self.sampling.processed(logits) if processed is None else processed
        places = positions.tolist()
        for old in [p for p in self._noise if p < min(places)]:
            del self._noise[old]
        chosen = torch.empty(len(places), dtype=torch.long, device=z.device)
        start = 0
        for end in range(1, len(places) + 1):  # runs of rows at one position (a tree in BFS order: one per depth)
            if end == len(places) or places[end] != places[start]:
                noise = self.noise(places[start], z.shape[-1], z.dtype, z.device)
                chosen[start:end] = (z[start:end] + noise).argmax(dim=-1)
                start = end
        return chosen


def draft_probabilities(processed: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                        every_row: bool = False, read: bool = True) -> list[float] | torch.Tensor:
    """Each tree node's probability under its parent's processed distribution (the root: 1.0), as plain floats.
    ``processed`` (n, V) per node (or more rows: padding); ``tokens``, ``parents`` (n,) in BFS order,
    ``parents[0] == -1``. ``every_row``: the totals are reduced over every row of ``processed`` (a fixed shape)
    rather than over the parents' rows alone. ``read`` False: the probabilities (n,) as a tensor where
    ``processed`` is, for the caller's own read.

    >>> z = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    >>> [round(p, 3) for p in draft_probabilities(z, torch.tensor([2, 1]), torch.tensor([-1, 0]))]
    [1.0, 0.25]
    """
    if tokens.numel() == 1:
        return [1.0] if read else processed.new_ones(1, dtype=torch.float64)
    if every_row:
        log_total = torch.logsumexp(processed, dim=-1)[parents[1:].to(processed.device)]
    else:
        up, inverse = parents[1:].to(processed.device).unique(return_inverse=True)  # each parent's row once
        log_total = torch.logsumexp(processed[up], dim=-1)[inverse]
    probs = (processed[parents[1:], tokens[1:].to(processed.device)] - log_total).exp()
    return [1.0] + probs.tolist() if read else torch.cat([probs.new_ones(1), probs])

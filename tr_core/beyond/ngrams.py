"""Drafts from the context: what followed earlier occurrences of the sequence's last tokens.

``ContextIndex`` keeps, for the prompt and the answer so far, every n-gram (n up to ``max_match``) with the
positions where it ended, so the longest earlier match of the sequence's end is a few dictionary look-ups, whatever
the context's length. Its ``continuations`` are the tokens that followed the match's latest occurrences, as a
frequency trie:

    [1, 2, 3, 1, 2, 4, 1, 2]  ->  match [1, 2] (ended at 1 and 4)  ->  root 2 -> 3 (1 of 2) -> 1 -> 2 ...
                                                                               -> 4 (1 of 2) -> 1 -> 2

The drafters that read it: ``suffix.SuffixDrafter`` ("suffix") and ``context.ContextRecyclingDrafter``
("tr-context", and "tr-plus").
"""

from __future__ import annotations

from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from typing import Iterable

import torch


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
        # the latest occurrence first: its nodes come first among equals
        return frequency_trie(root, match, [self.tokens[end + 1:end + 1 + depth] for end in reversed(ends)])


def frequency_trie(root: int, match: int, sequences: Iterable[Iterable[int]]) -> Continuations:
    """The frequency trie (``Continuations``) of ``sequences``, the continuations of ``match`` matched tokens' earlier
    occurrences (one each, the first given first among equals), under the node ``root``.

    >>> trie = frequency_trie(7, 1, [[3, 4], [3, 5], [6]])
    >>> trie.tokens, trie.parents, trie.counts
    ([7, 3, 4, 5, 6], [-1, 0, 1, 1, 0], [3, 2, 1, 1, 1])
    """
    tokens, parents, counts, children = [root], [-1], [0], [[]]
    first: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for sequence in sequences:
        counts[0] += 1
        node = 0
        for t in sequence:
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
    return Continuations(match, counts[0], tokens, parents, counts, children)


def caught_up(index: ContextIndex, context: torch.Tensor) -> ContextIndex:
    """``index`` extended with the tokens of ``context`` (L,) it has not seen yet: the decoding loop only ever
    appends to a request's context (a shorter one starts a new index)."""
    if context.numel() < len(index):
        index = ContextIndex(max_match=index.max_match)
    if context.numel() > len(index):
        index.extend(context[len(index):].tolist())
    return index

"""``LookaheadDrafter`` ("lookahead"): Lookahead decoding (Fu et al., 2024, "Break the Sequential Dependency of LLM
Inference Using Lookahead Decoding", arXiv 2402.02057), one of the training-free methods the Token Recycling paper
measures itself against.

Lookahead decoding makes its own drafts by Jacobi iteration. It keeps a two-dimensional window of guesses for the
tokens after the last one: ``N - 1`` levels of ``W`` guesses, each level the model's outputs at the level before
it, one step older. Every forward pass also computes one new level, so the window's diagonals are the model's
trajectories: each gives an ``N``-gram (its first token, then what the model went on to guess after it), kept in an
n-gram pool keyed by that first token. The same pass verifies up to ``G`` of the pool's n-grams that start with the
last token (the verification branch).

Both branches are one draft tree here, so the shared verification loop (``decoding.decode``) runs them in one
forward pass with its tree attention, and every token keeps the one position its depth gives it:

- the window's oldest level guesses positions 1 .. W-1 after the root, as a chain from the root;
- level ``l`` (1 <= l <= N-2) guesses positions l .. l+W-1: its guess at position ``p`` hangs under level l-1's guess
  at position p-1, so it attends to the oldest level's guesses before p-1 and to one guess of each later level, its
  diagonal (the mask of the paper's Figure 2, as a tree);
- each verified n-gram is a chain from the root.

Nodes with the same tokens from the root merge (a trie): their outputs would be the same. The loop accepts the
longest path the model agrees with anywhere in the tree, so a window guess that has converged to the model's own
output is accepted as well (Jacobi decoding's own acceptance).

    >>> window = JacobiWindow.filled(width=3, n=3, fill=[7, 8, 9, 10, 11])
    >>> window.levels                     # level 0: positions 1-2; level 1: positions 1-3
    [[7, 8], [9, 10, 11]]
    >>> draft = LookaheadDrafter(width=3, n=3, guesses=2, window=window)
    >>> d = draft.propose(torch.tensor([5, 1, 2, 5, 1, 3, 5]))   # the pool has 5 -> (1, 2) and, later, (1, 3)
    >>> d.tokens.tolist(), d.tree.parents.tolist()
    ([5, 1, 7, 9, 3, 2, 8, 10, 11], [-1, 0, 0, 0, 1, 1, 2, 2, 6])
    >>> d.tree.sources
    ('root', 'n-gram', 'window', 'window', 'n-gram', 'n-gram', 'window', 'window', 'window')
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..drafters import Draft, Needs, Outcome, PlainDrafter
from ..events import RowUpdate
from ..tree import tree_from_parents

# The sizes (W, N, G) measured for a model (``python -m tr_core.tools.build_assets --lookahead-only``), from the
# smallest window that makes trajectories to the paper's setting for 7B models on an A100 (W=15, N=5, G=15). Which
# one runs is chosen per machine (``choose_size``) from their measured tokens and nodes per step and t(N) here.
LADDER: tuple[tuple[int, int, int], ...] = ((2, 3, 1), (3, 3, 2), (4, 3, 3), (4, 4, 4), (5, 4, 5), (7, 4, 7),
                                            (7, 5, 7), (10, 5, 10), (15, 5, 15))
FALLBACK = (3, 3, 2)  # for a model without measured sizes: a small window, cheap wherever trees are not


def choose_size(measured: list[dict], step_ms: Callable[[float], float] | None) -> dict:
    """The size (``width``, ``n``, ``guesses``) of ``measured`` (each with its ``tokens_per_step`` and
    ``nodes_per_step``, as ``build_assets`` writes them) with the most tokens per ms on ``step_ms`` (a step's time
    for N tree tokens, measured on this machine), and why; ``FALLBACK`` where nothing was measured.

    >>> sizes = [dict(width=3, n=3, guesses=2, tokens_per_step=1.3, nodes_per_step=7.0),
    ...          dict(width=15, n=5, guesses=15, tokens_per_step=1.6, nodes_per_step=80.0)]
    >>> choose_size(sizes, lambda n: 10 + 0.5 * n)["width"]     # 1.3 / 13.5 ms beats 1.6 / 50 ms
    3
    >>> choose_size(sizes, lambda n: 10 + 0.001 * n)["width"]   # where nodes are nearly free, the big window
    15
    >>> choose_size(sizes, lambda n: 10 + 0.5 * n)["why"].split(": ")[1]
    '1.30 tokens a step over 7.0 nodes on the prompts it was measured on'
    >>> choose_size([], None)["why"]
    'no sizes measured for this model: the smallest useful window'
    """
    if not measured or step_ms is None:
        width, n, guesses = FALLBACK
        return dict(width=width, n=n, guesses=guesses, why="no sizes measured for this model: the smallest useful "
                                                           "window")
    best = max(measured, key=lambda m: m["tokens_per_step"] / step_ms(m["nodes_per_step"]))
    return dict(width=best["width"], n=best["n"], guesses=best["guesses"],
                why=f"of {len(measured)} sizes measured for the model, the most tokens per ms on this machine's "
                    f"step times: {best['tokens_per_step']:.2f} tokens a step over {best['nodes_per_step']:.1f} "
                    "nodes on the prompts it was measured on")


class NgramPool:
    """What followed each token in the window's trajectories and the context: ``key`` -> up to ``size``
    continuations of ``n - 1`` tokens, the latest seen last (an LRU set, as the paper's pool).

    >>> pool = NgramPool(n=3, size=2)
    >>> for cont in [(1, 2), (3, 4), (1, 2), (5, 6)]:
    ...     pool.add(9, cont)
    >>> pool.candidates(9), pool.candidates(8)
    ([(5, 6), (1, 2)], [])
    """

    def __init__(self, n: int, size: int):
        if n < 2 or size < 0:
            raise ValueError(f"an n-gram pool needs n >= 2 and size >= 0, got {n}, {size}")
        self.n, self.size = n, size
        self.table: dict[int, list[tuple[int, ...]]] = {}
        self.seen = 0  # how many of the context's tokens ``add_text`` has read

    def add(self, key: int, continuation: tuple[int, ...]) -> None:
        if len(continuation) != self.n - 1 or self.size == 0:
            return
        kept = self.table.setdefault(key, [])
        if continuation in kept:
            kept.remove(continuation)
        kept.append(continuation)
        if len(kept) > self.size:
            del kept[0]

    def add_text(self, tokens: list[int]) -> None:
        """Every n-gram of ``tokens`` not read before (the context grows at its end only; a shorter one starts
        over)."""
        if len(tokens) < self.seen:
            self.seen = 0
        for i in range(max(0, self.seen - self.n + 1), len(tokens) - self.n + 1):
            self.add(tokens[i], tuple(tokens[i + 1:i + self.n]))
        self.seen = len(tokens)

    def candidates(self, key: int) -> list[tuple[int, ...]]:
        """The continuations of ``key``, the latest first."""
        return self.table.get(key, [])[::-1]

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())


@dataclass
class JacobiWindow:
    """The lookahead branch's guesses: ``levels[0]`` for positions 1 .. W-1 after the root, ``levels[l]``
    (1 <= l <= N-2) for positions l .. l+W-1; the last level is the newest."""

    width: int
    n: int
    levels: list[list[int]]
    fill: list[int] = field(default_factory=list)  # tokens to pad a level with after a jump (cycled)
    cursor: int = 0

    @classmethod
    def filled(cls, width: int, n: int, fill: list[int]) -> "JacobiWindow":
        """A window of ``fill``'s tokens (cycled): the first guesses, before any trajectory."""
        window = cls(width, n, [], list(fill) or [0])
        window.levels = [window.padding(width - 1)] + [window.padding(width) for _ in range(n - 2)]
        return window

    def padding(self, count: int) -> list[int]:
        out = [self.fill[(self.cursor + i) % len(self.fill)] for i in range(count)]
        self.cursor = (self.cursor + count) % len(self.fill)
        return out

    def ngrams(self, root: int, outputs: list[int]) -> list[tuple[int, tuple[int, ...]]]:
        """The n-gram of each column: its oldest-level token (the root for column 0), one token of every later
        level along the diagonal, then the model's output at the newest one (``outputs[c]``), as (key,
        continuation)."""
        grams = []
        for c in range(self.width):
            first = root if c == 0 else self.levels[0][c - 1]
            grams.append((first, tuple(level[c] for level in self.levels[1:]) + (outputs[c],)))
        return grams

    def advance(self, outputs: list[int], moved: int) -> None:
        """Shift the window after the context grew by ``moved`` tokens (the accepted ones and the bonus): every
        level takes the next level's guesses for its positions, the newest level the model's ``outputs`` (its
        guesses for positions N-1 .. N+W-2 before the move), each padded where the move left no guess."""
        shift = moved - 1
        later = self.levels[1:] + [outputs]
        new = [self._pad(later[0][moved:moved + self.width - 1], self.width - 1)]
        for level in later[1:]:
            new.append(self._pad(level[shift:shift + self.width], self.width))
        self.levels = new

    def _pad(self, tokens: list[int], length: int) -> list[int]:
        return tokens + self.padding(length - len(tokens))


class LookaheadDrafter(PlainDrafter):
    """Lookahead decoding with window size ``width`` (W), n-gram size ``n`` (N) and at most ``guesses`` (G)
    n-grams verified a step. A drafter per request: its window and pool start from the prompt (the paper fills the
    pool with the prompt's n-grams, and so does this)."""

    name = "lookahead"
    needs = Needs()

    def __init__(self, width: int = FALLBACK[0], n: int = FALLBACK[1], guesses: int = FALLBACK[2],
                 window: JacobiWindow | None = None):
        if width < 1 or n < 3 or guesses < 0:
            raise ValueError(f"lookahead needs width >= 1, n >= 3 and guesses >= 0, got {width}, {n}, {guesses}")
        self.width, self.n, self.guesses = width, n, guesses
        self.pool = NgramPool(n, max(guesses, 1))
        self.window = window
        self._last: tuple[int, list[int]] | None = None  # (root token, newest level's node indices) of the draft

    def propose(self, context: torch.Tensor) -> Draft:
        ids = context.tolist()
        self.pool.add_text(ids)
        if self.window is None:
            self.window = JacobiWindow.filled(self.width, self.n, ids[-64:])
        root = ids[-1]
        tokens, parents, sources = [root], [-1], ["root"]
        child: dict[tuple[int, int], int] = {}

        def add(parent: int, token: int, source: str) -> int:
            node = child.get((parent, token))
            if node is None:
                node = child[parent, token] = len(tokens)
                tokens.append(token)
                parents.append(parent)
                sources.append(source)
            return node

        for continuation in self.pool.candidates(root)[:self.guesses]:  # the verification branch
            node = 0
            for token in continuation:
                node = add(node, token, "n-gram")
        before = [0]  # the previous level's node at each position (the oldest level: the root at 0)
        for token in self.window.levels[0]:
            before.append(add(before[-1], token, "window"))
        for level, guesses in enumerate(self.window.levels[1:], start=1):
            before = {level + j: add(before[level + j - 1], token, "window") for j, token in enumerate(guesses)}
        tree, order = tree_from_parents(parents, [0] + [-1] * (len(tokens) - 1), name="lookahead", sources=sources)
        place = {old: new for new, old in enumerate(order)}
        self._last = (root, [place[before[p]] for p in sorted(before)])
        return Draft(torch.tensor([tokens[i] for i in order], dtype=torch.long, device=context.device), tree)

    def learn(self, outcome: Outcome) -> list[RowUpdate]:
        if outcome.is_prompt or self._last is None:
            return []
        root, newest = self._last
        verified = outcome.tokens.numel()
        rows = [i for i in newest if i < verified]
        greedy = outcome.logits[rows].argmax(dim=-1).tolist() if rows else []
        guess = dict(zip(rows, greedy))
        last_level = self.window.levels[-1]
        # a node the loop had no room to verify keeps its old guess
        outputs = [guess.get(i, last_level[c]) for c, i in enumerate(newest)]
        for c, (key, continuation) in enumerate(self.window.ngrams(root, outputs)):
            if newest[c] in guess:
                self.pool.add(key, continuation)
        self.window.advance(outputs, moved=outcome.path.numel())
        return []

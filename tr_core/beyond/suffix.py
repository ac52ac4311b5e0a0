"""``SuffixDrafter`` ("suffix"): a training-free baseline after SuffixDecoding (Oliaro et al., arXiv 2411.04975),
which speculates with a tree of the most frequent continuations of the longest suffix match. Here the tree is grown
best-first in the frequency trie of the current request's context (``ngrams.ContextIndex``; SuffixDecoding also
indexes earlier outputs).
"""

from __future__ import annotations

import torch

from ..drafters import Draft, PlainDrafter
from ..tree import chain_tree, tree_from_parents
from .ngrams import ContextIndex, Continuations, caught_up


class SuffixDrafter(PlainDrafter):
    """Speculation from the context alone: a tree of at most ``max_nodes`` draft nodes (the root extra), grown
    best-first from the continuations of the longest match (at least ``min_match`` tokens) over its latest
    ``max_occurrences`` occurrences; no match: the root alone. A drafter per request: it indexes the context it is
    given.

    >>> draft = SuffixDrafter(max_nodes=4).propose(torch.tensor([1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2]))
    >>> draft.tokens.tolist(), draft.tree.parents.tolist(), draft.tree.sources[:2]
    ([2, 3, 4, 1, 2], [-1, 0, 0, 1, 3], ('root', 'context'))
    """

    name = "suffix"

    def __init__(self, max_nodes: int = 8, max_match: int = 16, min_match: int = 1, max_occurrences: int = 16):
        if max_nodes < 1 or min_match < 1 or max_occurrences < 1:
            raise ValueError("a suffix drafter needs max_nodes, min_match and max_occurrences >= 1")
        self.max_nodes, self.min_match, self.max_occurrences = max_nodes, min_match, max_occurrences
        self.index = ContextIndex(max_match=max_match)

    def propose(self, context: torch.Tensor) -> Draft:
        self.index = caught_up(self.index, context)
        trie = self.index.continuations(self.max_nodes, self.max_occurrences)
        nodes = trie.best_first(self.max_nodes) if trie.match >= self.min_match else []
        return trie_draft(context, trie, nodes, "suffix", "context")


def trie_draft(context: torch.Tensor, trie: Continuations, nodes: list[int], name: str, source: str) -> Draft:
    """The draft of a frequency trie's chosen ``nodes`` (``Continuations.best_first``) under the context's last token,
    each drafted node's source said to be ``source``; no nodes: the root alone."""
    if not nodes:
        return Draft(context[-1:].clone(), chain_tree(0))
    place = {node: i for i, node in enumerate(nodes, start=1)}
    parents = [-1] + [place.get(trie.parents[node], 0) for node in nodes]
    tree, order = tree_from_parents(parents, [0] + [-1] * len(nodes), name=name,
                                    sources=["root"] + [source] * len(nodes))
    drafted = [int(context[-1])] + [trie.tokens[node] for node in nodes]
    return Draft(torch.tensor([drafted[i] for i in order], dtype=torch.long, device=context.device), tree)

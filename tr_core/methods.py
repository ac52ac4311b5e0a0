"""The decoding methods, named once: what each is called, what it adds, and whether it is the paper's method, a
baseline, or one of this project's extensions beyond the paper.

Every method verifies its drafts the same way (``decoding.decode``): greedy output equal to plain decoding's.

>>> [m.name for m in METHODS.values() if m.beyond_paper]
['tr-context', 'tr-dynamic', 'tr-plus']
>>> METHODS["suffix"].label
'Suffix decoding'
>>> [m.name for m in METHODS.values() if m.paper_a100]   # the paper's training-free comparison
['pld', 'rest', 'lookahead', 'tr']
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str  # as the CLI, the benchmark, the app and the step events spell it
    label: str  # for people
    about: str  # one sentence: what it drafts from, or what it adds to Token Recycling
    uses_matrix: bool  # drafts from (and teaches) the adjacency matrix
    beyond_paper: bool = False  # an extension of Token Recycling, not the paper's method
    # the paper's A100 figures (Token Recycling, arXiv 2408.08696, citing Spec-Bench's leaderboard: Vicuna-7B on one
    # A100, greedy): overall speedup over plain decoding and mean tokens per forward pass; None: not in its comparison
    paper_a100: tuple[float, float] | None = None


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("plain", "plain decoding", "No draft: one token per forward pass (greedy, or sampled as set).", False),
    Method("pld", "Prompt Lookup Decoding",
           "Copies the tokens that followed the latest earlier occurrence of the last few tokens, as a chain.", False,
           paper_a100=(1.66, 1.75)),
    Method("suffix", "Suffix decoding",
           "A small tree of the continuations that most often followed the longest earlier match of the context's "
           "end (after SuffixDecoding, arXiv 2411.04975).", False),
    Method("rest", "REST",
           "Retrieval: a tree of what most often followed the longest match of the context's end in a datastore of "
           "text fixed beforehand (here the Python standard library's sources; after He et al., arXiv 2311.08252).",
           False, paper_a100=(1.48, 1.82)),
    Method("lookahead", "Lookahead decoding",
           "Jacobi iteration: a window of guesses refined every step, whose trajectories fill a pool of n-grams, "
           "the ones that start with the last token verified in the same pass (after Fu et al., arXiv 2402.02057).",
           False, paper_a100=(1.34, 1.64)),
    Method("tr", "Token Recycling",
           "The paper's method: a draft tree retrieved from the adjacency matrix by a fixed template.", True,
           paper_a100=(2.22, 2.73)),
    Method("tr-context", "Token Recycling + context",
           "Adds a branch copied from the longest earlier match in the context to the matrix's tree, sized by how "
           "often such branches were accepted.", True, beyond_paper=True),
    Method("tr-dynamic", "Token Recycling, best-first tree",
           "Keeps each candidate's probability in the matrix and grows each step's tree towards the likeliest paths "
           "instead of a fixed template.", True, beyond_paper=True),
    Method("tr-plus", "Token Recycling, best-first + context",
           "Both: the best-first tree from the matrix and the branch from the context, in one node budget.", True,
           beyond_paper=True),
)}

NAMES = tuple(METHODS)


def label(name: str) -> str:
    """The method's name for people (the name itself if unknown)."""
    return METHODS[name].label if name in METHODS else name


def check(name: str) -> str:
    """``name`` if it is a method, else a ValueError that lists them."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(NAMES)}")
    return name

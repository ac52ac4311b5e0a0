"""The decoding methods, named once: what each is called, what it adds, whether it is the paper's method, a
baseline, a rival or one of this project's extensions beyond the paper, and how it runs (which drafter, on which
tree, from which matrix). The engine (``Engine.drafter``), the command line, the benchmark, the app and the device
check read them here.

Every method verifies its drafts the same way (``decoding.decode``): greedy output equal to plain decoding's.

>>> [m.name for m in METHODS.values() if m.beyond_paper]
['tr-context', 'tr-dynamic', 'tr-plus']
>>> METHODS["suffix"].label
'Suffix decoding'
>>> [m.name for m in METHODS.values() if m.paper_a100]   # the paper's training-free comparison
['pld', 'rest', 'lookahead', 'tr']
>>> [(m.name, m.drafts, m.tree) for m in METHODS.values() if m.drafts != m.name]  # variants of another's drafter
[('tr-paper', 'tr', 'paper'), ('tr-cold', 'tr', None)]
>>> [n for n in NAMES if n not in APP_NAMES]  # the app's tree menu and hot-start box give these already
['tr-paper', 'tr-cold']
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
    kind: str = "rival"  # "baseline", "paper" (Token Recycling as the paper runs it), "rival", "beyond"
    drafts: str = ""  # the drafter it runs ("": its own name); a variant runs another's with its own settings
    tree: str | None = None  # the draft tree it runs on (None: the engine's, "auto" by default)
    seed_from_prompt: bool | None = None  # whether the matrix learns from the prompt first (None: the engine's)
    cold_start: bool = False  # starts every prompt from an empty matrix (no hot start)
    in_app: bool = True  # offered by the app's method menus

    def __post_init__(self):
        if not self.drafts:
            object.__setattr__(self, "drafts", self.name)
        if self.beyond_paper:
            object.__setattr__(self, "kind", "beyond")

    def settings(self) -> dict:
        """The engine settings (``EngineConfig`` fields) it runs with beyond the engine's own."""
        out = {"method": self.drafts}
        if self.tree is not None:
            out["tree"] = self.tree
        if self.seed_from_prompt is not None:
            out["seed_from_prompt"] = self.seed_from_prompt
        if self.cold_start:
            out["matrix_path"] = None
        return out


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("plain", "plain decoding", "No draft: one token per forward pass (greedy, or sampled as set).", False,
           kind="baseline"),
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
           "The paper's method: a draft tree retrieved from the adjacency matrix, by default the one fitted to this "
           "machine's step times, its size adapted online.", True, paper_a100=(2.22, 2.73), kind="paper"),
    Method("tr-paper", "Token Recycling, the paper's 81-node tree",
           "The paper's method exactly as it runs it: its fixed 81-node tree from the adjacency matrix, the matrix "
           "carried from prompt to prompt and not seeded from the prompt.", True, kind="paper", drafts="tr",
           tree="paper", seed_from_prompt=False, in_app=False),
    Method("tr-cold", "Token Recycling, cold start",
           "Token Recycling from an empty matrix on every prompt: what the hot start adds.", True, kind="paper",
           drafts="tr", cold_start=True, in_app=False),
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
APP_NAMES = tuple(n for n, m in METHODS.items() if m.in_app)


def label(name: str) -> str:
    """The method's name for people (the name itself if unknown)."""
    return METHODS[name].label if name in METHODS else name


def check(name: str) -> str:
    """``name`` if it is a method, else a ValueError that lists them."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(NAMES)}")
    return name

"""``RestDrafter`` ("rest"): Retrieval-Based Speculative Decoding (He et al., 2023, arXiv 2311.08252), one of the
training-free methods the Token Recycling paper measures itself against.

REST drafts from a datastore of text fixed before decoding, not from the request: it finds the longest suffix of the
context that occurs in the datastore, takes what followed its occurrences there, and verifies the likeliest of those
continuations as a draft tree (a frequency trie, grown best-first), with the same tree attention as every method.

``Datastore``: token ids of the corpus (documents separated by ``SEP``) and a suffix array sorted by each suffix's
first ``SORTED`` tokens, enough to find every occurrence of a pattern of up to ``SORTED`` tokens by binary search.
``python_sources_datastore``: the one this project builds, from the Python standard library's sources (present on
every Python install; code, and English in its docstrings and comments), tokenized by the model's tokenizer, cached
per tokenizer outside the repository and shared read-only by every request of the process.

    >>> store = Datastore(np.array([5, 6, 7, 8, SEP, 5, 6, 9, SEP, 6, 7, 8], dtype=np.int32))
    >>> store.longest_match([1, 5, 6])          # [5, 6] occurs twice (followed by positions 2 and 7); [1, 5, 6] never
    (2, [2, 7])
    >>> trie = store.continuations([1, 5, 6], depth=2)
    >>> trie.tokens, trie.counts                # after [5, 6]: 7 8 once, 9 once (the separator ends a continuation)
    ([6, 7, 8, 9], [2, 1, 1, 1])
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from ..beyond.dynamic import PathCalibration
from ..beyond.ngrams import Continuations, frequency_trie
from ..beyond.suffix import trie_draft
from ..drafters import Draft, Outcome, PlainDrafter
from ..models import default_cache_dir, file_name

SEP = -1  # between documents: no match or continuation crosses it
SORTED = 16  # the suffix array orders suffixes by this many tokens: the longest match searched

# the datastore this project builds: the standard library's top-level modules, in name order, up to this many bytes
SOURCE_BYTES = 6 << 20


@dataclass
class Datastore:
    """Token ids (int32, documents separated by ``SEP``) and their suffix array; ``about`` says what they are."""

    tokens: np.ndarray
    about: dict = field(default_factory=dict)
    order: np.ndarray | None = None  # the suffix array: start positions, by their first SORTED tokens

    def __post_init__(self):
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int32)
        if self.order is None:
            self.order = suffix_array(self.tokens, SORTED)

    def __len__(self) -> int:
        return int(self.tokens.size)

    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """The suffix array's slice of the suffixes that start with ``pattern`` (empty: lo == hi)."""
        tokens, order, m = self.tokens, self.order, len(pattern)

        def below(i: int, strict: bool) -> bool:  # suffix order[i]'s first m tokens < pattern (or <= if not strict)
            start = int(order[i])
            head = tokens[start:start + m].tolist()
            return head < pattern if strict else head <= pattern

        lo, hi = 0, len(order)
        while lo < hi:  # the first suffix not below the pattern
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if below(mid, True) else (lo, mid)
        first, hi = lo, len(order)
        while lo < hi:  # the first suffix above every one that starts with it
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if below(mid, False) else (lo, mid)
        return first, lo

    def longest_match(self, context: list[int], limit: int | None = None) -> tuple[int, list[int]]:
        """The length m of the context's longest suffix (at most ``SORTED`` tokens, no ``SEP``) that occurs in the
        datastore, and the positions just after up to ``limit`` of its occurrences (all: None), ascending, those at a
        document's end left out; (0, []) when not even the last token occurs."""
        context = [int(t) for t in context[-SORTED:]]
        best = (0, (0, 0))
        lo, hi = 1, len(context)
        while lo <= hi:  # a suffix that occurs contains shorter ones that do: binary search over its length
            m = (lo + hi) // 2
            found = self._range(context[-m:])
            if found[1] > found[0]:
                best, lo = (m, found), m + 1
            else:
                hi = m - 1
        m, (first, last) = best
        if m == 0:
            return 0, []
        starts = self.order[first:last]
        if limit is not None and starts.size > limit:  # evenly over the occurrences (they are in continuation order)
            starts = starts[np.linspace(0, starts.size - 1, limit).round().astype(np.int64)]
        after = np.sort(starts.astype(np.int64) + m)
        return m, [int(p) for p in after if p < self.tokens.size and self.tokens[p] != SEP]

    def continuations(self, context: list[int], depth: int, max_occurrences: int = 64) -> Continuations:
        """What followed the longest match's occurrences (up to ``max_occurrences``), up to ``depth`` tokens each and
        never past a document's end, as a frequency trie under the context's last token."""
        match, after = self.longest_match(context, max_occurrences)
        sequences = []
        for p in after:
            run = self.tokens[p:p + depth]
            cut = np.flatnonzero(run == SEP)
            sequences.append(run[:cut[0] if cut.size else run.size].tolist())
        return frequency_trie(int(context[-1]) if len(context) else -1, match, sequences)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=self.tokens, order=self.order, about=np.array(json.dumps(self.about)))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "Datastore":
        with np.load(path) as data:
            return cls(data["tokens"], json.loads(str(data["about"])), data["order"])


def suffix_array(tokens: np.ndarray, length: int = SORTED) -> np.ndarray:
    """Start positions of ``tokens``' suffixes, ordered by their first ``length`` tokens (a shorter suffix before the
    longer ones it begins; ties in start order), by prefix doubling.

    >>> suffix_array(np.array([2, 1, 2, 1, 3]), 16).tolist()   # 1 2 1 3 < 1 3 < 2 1 2 1 3 < 2 1 3 < 3
    [1, 3, 0, 2, 4]
    """
    n = tokens.size
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64) + 1  # 0: past the end
    span = 1
    while span < length:
        following = np.zeros(n, dtype=np.int64)
        if span < n:
            following[:n - span] = rank[span:]
        order = np.lexsort((following, rank))  # by rank, then by the rank span tokens on
        pair_r, pair_f = rank[order], following[order]
        new = np.empty(n, dtype=np.int64)
        new[order] = np.cumsum(np.r_[True, (pair_r[1:] != pair_r[:-1]) | (pair_f[1:] != pair_f[:-1])])
        rank, span = new, span * 2
    return np.argsort(rank, kind="stable").astype(np.int32)


def python_sources(limit: int = SOURCE_BYTES) -> list[Path]:
    """The standard library's top-level ``.py`` files, in name order, up to ``limit`` bytes in all."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(folder.glob("*.py")):
        size = path.stat().st_size
        if total + size > limit:
            break
        chosen.append(path)
        total += size
    return chosen


def build_datastore(tokenizer, texts: Iterable[tuple[str, str]], about: dict | None = None) -> Datastore:
    """A datastore of ``texts`` ((name, text) pairs) tokenized by ``tokenizer`` (no special tokens), separated by
    ``SEP``."""
    started = time.perf_counter()
    parts, names = [], []
    for name, text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        parts += [np.asarray(ids, dtype=np.int32), np.array([SEP], dtype=np.int32)]
        names.append(name)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    store = Datastore(tokens, dict(about or {}, documents=len(names), tokens=int(tokens.size)))
    store.about["build_seconds"] = round(time.perf_counter() - started, 1)
    return store


_STORES: dict[str, Datastore] = {}
_LOCK = threading.Lock()


_KEYS: dict[int, tuple[object, str]] = {}  # id(tokenizer) -> (the tokenizer, kept alive; its key)


def tokenizer_key(tokenizer) -> str:
    """A tokenizer's identity for the cache: its name and a digest of its vocabulary (computed once per tokenizer)."""
    known = _KEYS.get(id(tokenizer))
    if known is not None and known[0] is tokenizer:
        return known[1]
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(repr(vocab).encode()).hexdigest()[:12]
    name = Path(str(getattr(tokenizer, "name_or_path", "") or "tokenizer")).name or "tokenizer"
    key = file_name(f"{name}-{digest}")
    _KEYS[id(tokenizer)] = (tokenizer, key)
    return key


def python_sources_datastore(tokenizer, cache_dir: Path | None = None) -> Datastore:
    """This project's datastore for ``tokenizer``: the Python standard library's sources (``python_sources``), read
    from the cache folder, or built and cached there on first use; one per process and tokenizer, shared."""
    key = tokenizer_key(tokenizer)
    with _LOCK:
        if key in _STORES:
            return _STORES[key]
        sources = python_sources()
        digest = hashlib.sha256("".join(f"{p.name}:{p.stat().st_size}" for p in sources).encode()).hexdigest()[:8]
        path = (cache_dir or default_cache_dir()) / "rest" / f"{key}-stdlib-{digest}.npz"
        if path.is_file():
            store = Datastore.load(path)
        else:
            texts = ((p.name, p.read_text(encoding="utf-8", errors="replace")) for p in sources)
            store = build_datastore(tokenizer, texts, {"source": f"the Python {sysconfig.get_python_version()} "
                                                                 f"standard library's top-level modules",
                                                       "bytes": sum(p.stat().st_size for p in sources)})
            store.save(path)
        _STORES[key] = store
        return store


def sized(counts: list[int], occurrences: int, step_ms: Callable[[int], float] | None, max_nodes: int,
          factor: float = 1.0) -> int:
    """How many of a trie's best-first nodes (their ``counts``, in that order) to draft: with ``step_ms`` (a step's
    time for N tree tokens, the root included, measured here), the number with the most expected tokens per ms, each
    node's chance of acceptance taken as its count over the occurrences (the datastore's estimate) times ``factor``
    (how far such estimates came true so far, ``PathCalibration``), 1 for the bonus token; without ``step_ms``, all
    of them (at most ``max_nodes``).

    >>> sized([8, 6, 1], 10, lambda n: 10.0 + n, 8)   # 1 + .8 + .6 tokens for 13 ms beats 2.4 + .1 for 14 ms
    2
    >>> sized([8, 6, 1], 10, None, 8), sized([], 10, lambda n: 10.0, 8)
    (3, 0)
    >>> sized([8, 6, 1], 10, lambda n: 10.0 + n, 8, factor=0.1)   # estimates that came true a tenth as often
    0
    """
    counts = counts[:max_nodes]
    if step_ms is None or not counts or occurrences <= 0:
        return len(counts)
    best, best_rate, expected = 0, 1.0 / step_ms(1), 1.0
    for n, count in enumerate(counts, start=1):
        expected += factor * count / occurrences
        rate = expected / step_ms(n + 1)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


class RestDrafter(PlainDrafter):
    """REST's draft: of the continuations that followed the longest datastore match of the context's end (up to
    ``max_occurrences`` of its occurrences, ``depth`` tokens each), the likeliest trie nodes, grown best-first: at
    most ``max_nodes``, and where ``step_ms`` (t(N) measured on this machine) is given, as many as maximise the
    expected tokens per ms (``sized``), the datastore's estimates scaled by how often they came true before
    (``calibration``, kept across requests by the engine); no match: the root alone.

    >>> store = Datastore(np.array([1, 2, 3, 4, 1, SEP, 1, 2, 3, 5, SEP, 2, 3, 4, 2], dtype=np.int32))
    >>> draft = RestDrafter(store, max_nodes=3).propose(torch.tensor([9, 2, 3]))  # after 2 3: 4 1, 5, 4 2
    >>> draft.tokens.tolist(), draft.tree.parents.tolist(), draft.tree.sources[:2]
    ([3, 4, 5, 1], [-1, 0, 0, 1], ('root', 'datastore'))
    >>> RestDrafter(store, step_ms=lambda n: 10.0 + 8 * n).propose(torch.tensor([9, 2, 3])).tokens.tolist()
    [3, 4]
    """

    name = "rest"

    def __init__(self, store: Datastore, max_nodes: int = 8, depth: int = 6, max_occurrences: int = 64,
                 step_ms: Callable[[int], float] | None = None, calibration: PathCalibration | None = None):
        if max_nodes < 1 or depth < 1 or max_occurrences < 1:
            raise ValueError("a REST drafter needs max_nodes, depth and max_occurrences >= 1")
        self.store, self.max_nodes, self.depth, self.max_occurrences = store, max_nodes, depth, max_occurrences
        self.step_ms, self.calibration = step_ms, calibration or PathCalibration()
        self._predicted = 0.0  # the drafted nodes' estimated chances, summed (uncalibrated)

    def propose(self, context: torch.Tensor) -> Draft:
        tail = context[-SORTED:].tolist()
        trie = self.store.continuations(tail, self.depth, self.max_occurrences)
        nodes = trie.best_first(self.max_nodes)
        counts = [trie.counts[i] for i in nodes]
        n = sized(counts, trie.occurrences, self.step_ms, self.max_nodes, self.calibration.factor)
        nodes = nodes[:n]
        self._predicted = sum(counts[:n]) / trie.occurrences if n else 0.0
        return trie_draft(context, trie, nodes, "rest", "datastore")

    def learn(self, outcome: Outcome) -> list:
        if not outcome.is_prompt and outcome.whole:
            self.calibration.observe(self._predicted, outcome.path.numel() - 1)
        return []

"""Batch invariance of a whole prepared model: whether a token's logits are the same bits alone (a plain step),
inside draft trees of the sizes the engine runs, and inside a prefill fed in pieces.

``layouts.row_invariant`` checks each linear layout alone; a format's whole forward also has its small operations,
its attention and its prefill chunks, any of which can make a row's numbers depend on the rows beside it (seen on an
Intel Xeon with AMX: torch's bf16 format passed every layout's check and gave other logits for prompts fed in 7- or
32-token pieces). ``chooser.choose_plan`` runs ``check`` on each format's prepared model and offers only those that
pass; ``tests/test_invariance.py`` asks the same function, so the two cannot disagree.

>>> differences({"alone": [torch.tensor([1.0, 2.0])], "tree of 2": [torch.tensor([1.0, 2.5])]})
{'tree of 2': [1]}
"""

from __future__ import annotations

import torch
from torch import nn

from ..tree import tree_from_parents
from .backend import tree_mask
from .kernels import OutputHead, body, cache_dtype, feed
from .kv import keep_accepted_path, new_cache

# the cached tokens before the positions checked: inside an attention window, and near its end (a prefill chunk of
# up to 63 rows reaches them)
PASTS = (130, 187)
DEPTH = 3  # the positions checked: the one after the cache and the next three, a path of depth 3 in each tree
TREE_SIZES = (2, 4, 8, 16, 81)
CHUNKS = (7, 32, 1000)  # prefill pieces (each split again at the attention windows' boundaries)


def probe_ids(vocab: int, length: int = max(PASTS) + DEPTH + 1, seed: int = 0) -> torch.Tensor:
    """``length`` token ids drawn from ``vocab`` with a fixed seed: the input ``check`` uses where it is given none
    (a row's invariance does not depend on the text being language)."""
    return torch.randint(vocab, (length,), generator=torch.Generator().manual_seed(seed))


def tree_with_chain(chain: list[int], size: int, vocab: int) -> tuple[list[int], list[int], list[int]]:
    """Parents and tokens of a ``size``-node tree holding ``chain`` (root first) as one path, the other nodes random
    siblings placed before the chain's node at each depth; and the chain's node indices.

    >>> tree_with_chain([5, 6], 3, 10)[0], tree_with_chain([5, 6], 3, 10)[2]
    ([-1, 0, 0], [0, 2])
    """
    g = torch.Generator().manual_seed(size)
    parents, tokens, nodes = [-1], [chain[0]], [0]
    extra = size - len(chain)
    for d in range(1, len(chain)):  # (a chain of one node: the root alone)
        for _ in range(extra // (len(chain) - 1) + (d <= extra % (len(chain) - 1))):
            parents.append(nodes[d - 1])
            tokens.append(int(torch.randint(vocab, (1,), generator=g)))
        parents.append(nodes[d - 1])
        tokens.append(chain[d])
        nodes.append(len(parents) - 1)
    return parents, tokens, nodes


@torch.inference_mode()
def position_logits(model: nn.Module, ids: torch.Tensor, pasts: tuple[int, ...] = PASTS
                    ) -> dict[int, dict[str, list[torch.Tensor]]]:
    """Per past in ``pasts``, the logits after the tokens at positions ``past`` to ``past + DEPTH`` of ``ids``,
    computed: alone, one step at a time (as plain decoding does); as a path inside trees of ``TREE_SIZES`` nodes on
    the same cached prefix; inside prefills of ``ids`` fed in ``CHUNKS`` (one prefill per chunk size serves every
    past)."""
    base, head, dtype = body(model), OutputHead(model), model.dtype
    end = max(pasts) + DEPTH + 1
    if ids.numel() < end:
        raise ValueError(f"the check needs {end} ids, got {ids.numel()}")
    capacity = end + max(TREE_SIZES)
    out: dict[int, dict[str, list[torch.Tensor]]] = {past: {} for past in pasts}
    for past in pasts:
        chain = ids[past:past + DEPTH + 1].tolist()
        cache = new_cache(model.config, capacity, cache_dtype(base, dtype))
        feed(base, ids[:past], cache)
        for size in TREE_SIZES:
            parents, tokens, nodes = tree_with_chain(chain[:size], size, model.config.vocab_size)
            tree, order = tree_from_parents(parents, [0] * size)
            assert order == list(range(size))
            hidden = base(input_ids=torch.tensor([tokens]), position_ids=(past + tree.depth)[None],
                          attention_mask=tree_mask(tree, past, dtype, torch.device("cpu")),
                          cache=cache).last_hidden_state[0]
            logits = head(hidden)
            out[past][f"tree of {size}"] = [logits[i] for i in nodes]
            keep_accepted_path(cache, past, size, torch.zeros(0, dtype=torch.long))  # back to the prefix
        alone = []
        for i, token in enumerate(chain):
            hidden = base(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[past + i]]),
                          cache=cache).last_hidden_state[0]
            alone.append(head(hidden)[0])
        out[past]["alone"] = alone
    for chunk in CHUNKS:
        cache, rows = new_cache(model.config, capacity, cache_dtype(base, dtype)), []
        for start in range(0, end, chunk):
            rows.append(head(feed(base, ids[start:min(start + chunk, end)], cache)))
        logits = torch.cat(rows)
        for past in pasts:
            out[past][f"prefill in {chunk}s"] = [logits[past + i] for i in range(DEPTH + 1)]
    return out


def differences(logits: dict[str, list[torch.Tensor]]) -> dict[str, list[int]]:
    """Per way of computing, the number of logits differing from the one-at-a-time ones, per position (a tree of
    fewer nodes than positions holds the first ones)."""
    alone = logits["alone"]
    return {how: [int((a != b).sum()) for a, b in zip(alone, rows)] for how, rows in logits.items() if how != "alone"}


def all_equal(found: dict[str, list[int]]) -> bool:
    """Whether ``differences`` found every way of computing, at every position it holds, bit for bit equal.

    >>> all_equal({"tree of 2": [0, 0], "prefill in 7s": [0, 0, 0, 0]}), all_equal({"tree of 2": [0, 1]})
    (True, False)
    """
    def complete(how: str, counts: list[int]) -> bool:
        return len(counts) == (min(DEPTH + 1, int(how.split()[-1])) if how.startswith("tree") else DEPTH + 1)
    return all(complete(h, d) for h, d in found.items()) and not any(any(d) for d in found.values())


def check(model: nn.Module, ids: torch.Tensor | None = None, pasts: tuple[int, ...] = PASTS
          ) -> dict[int, dict[str, list[int]]]:
    """Per past, ``differences`` of ``position_logits`` for ``model`` as prepared (its kernels, its dtype) on ``ids``
    (default ``probe_ids``): empty lists of zeros where it is batch-invariant (``verdict``)."""
    ids = probe_ids(model.config.vocab_size) if ids is None else ids
    return {past: differences(by_way) for past, by_way in position_logits(model, ids, pasts).items()}


def verdict(found: dict[int, dict[str, list[int]]]) -> str:
    """``""`` where ``check`` found every row the same, else what differed first, in words.

    >>> verdict({130: {"tree of 2": [0, 0], "prefill in 7s": [0, 3, 0, 0]}})
    'gave other logits in a prefill in 7s than alone (at a 130-token past: [0, 3, 0, 0] differing)'
    """
    for past, by_way in found.items():
        if not all_equal(by_way):
            how, counts = next((h, d) for h, d in by_way.items() if any(d) or not all_equal({h: d}))
            return f"gave other logits in a {how} than alone (at a {past}-token past: {counts} differing)"
    return ""

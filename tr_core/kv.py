"""The one place that touches KV-cache internals: keeping only the accepted path of a verified tree."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def keep_accepted_path(cache: DynamicCache, past_len: int, tree_size: int, path: torch.Tensor) -> None:
    """The cache holds ``past_len`` context positions followed by ``tree_size`` tree nodes. Keep the context and
    the nodes of ``path`` (increasing node indices, root first), so the cache ends at ``past_len + len(path)``.

    The accepted nodes are moved down over the tree's first slots (a gather, then a slice write), and the rest of
    the tree is cut with the public ``crop``.
    """
    kept = path.numel()
    if tree_size > kept and not torch.equal(path, torch.arange(kept, device=path.device)):
        src = past_len + path
        for layer in cache.layers:
            layer.keys[..., past_len:past_len + kept, :] = layer.keys.index_select(-2, src)
            layer.values[..., past_len:past_len + kept, :] = layer.values.index_select(-2, src)
    if tree_size > kept:
        cache.crop(-(tree_size - kept))

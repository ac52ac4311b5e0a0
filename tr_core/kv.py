"""The one place that touches KV-cache internals: a cache that grows without copying, and keeping only the accepted
path of a verified tree."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of buffers allocated for ``capacity`` positions.

    transformers' ``DynamicLayer`` concatenates on every update, which copies the whole cache of every layer at every
    step: its cost grows with the context (for the embedded model 2 x 30 layers of keys and values per step). Here an
    update writes the new positions into the buffer and returns a longer view of it; the buffer is reallocated (at
    least doubled) only when it is full. ``keys``/``values`` stay views that ``crop`` and in-place writes work on as
    before; a layer whose tensors were replaced from outside is taken over into a new buffer.
    """

    def __init__(self, capacity: int = 256):
        super().__init__()
        self.capacity = max(1, int(capacity))
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def _own_views(self) -> bool:
        buf = self._key_buf
        return (buf is not None and self.keys.data_ptr() == buf.data_ptr() and self.values.data_ptr()
                == self._value_buf.data_ptr() and self.keys.stride() == buf.stride())

    def _reserve(self, length: int, needed: int, like: torch.Tensor) -> None:
        if self._own_views() and needed <= self._key_buf.shape[-2]:
            return
        capacity = max(needed, self.capacity, 2 * (self._key_buf.shape[-2] if self._key_buf is not None else 0))
        shape = (*like.shape[:-2], capacity, like.shape[-1])
        key_buf = like.new_empty(shape)
        value_buf = like.new_empty(shape)
        if length:
            key_buf[..., :length, :] = self.keys
            value_buf[..., :length, :] = self.values
        self._key_buf, self._value_buf = key_buf, value_buf

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.keys.shape[-2] if self.keys.numel() else 0
        end = length + key_states.shape[-2]
        self._reserve(length, end, key_states)
        self._key_buf[..., length:end, :] = key_states
        self._value_buf[..., length:end, :] = value_states
        self.keys = self._key_buf[..., :end, :]
        self.values = self._value_buf[..., :end, :]
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buf = self._value_buf = None
        super().reset()


def new_cache(config: PretrainedConfig, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are ``PreallocatedLayer``s of ``capacity``
    positions (sliding-window and other special layers stay as transformers makes them)."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


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

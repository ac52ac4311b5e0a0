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
        buf = self._key_buf
        if buf is not None and needed <= buf.shape[-2]:
            if length and self._own_views():
                return
            if not length and (buf.shape[:-2], buf.shape[-1], buf.dtype, buf.device) == (
                    like.shape[:-2], like.shape[-1], like.dtype, like.device):
                return  # an empty layer with buffers given in advance (new_cache)
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
        # narrow() rather than [..., a:b, :]: a few microseconds less per call, 60 calls a step
        self._key_buf.narrow(-2, length, end - length).copy_(key_states)
        self._value_buf.narrow(-2, length, end - length).copy_(value_states)
        return self.cut(end)

    def cut(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Make ``keys``/``values`` the buffers' first ``length`` positions (the layer must own its views)."""
        self.keys = self._key_buf.narrow(-2, 0, length)
        self.values = self._value_buf.narrow(-2, 0, length)
        return self.keys, self.values

    def reset(self) -> None:
        self._key_buf = self._value_buf = None
        super().reset()


def new_cache(config: PretrainedConfig, capacity: int, dtype: torch.dtype | None = None,
              device: torch.device | str = "cpu") -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are ``PreallocatedLayer``s of ``capacity``
    positions (sliding-window and other special layers stay as transformers makes them).

    Given the ``dtype``, and where the config names its key/value heads, every layer's buffers are slices of one
    tensor (``cache.kv_store``, (2 x layers, kv heads, capacity, head dim)), so that ``keep_accepted_path`` moves the
    accepted nodes of all layers in one gather instead of one per layer and tensor.
    """
    cache = DynamicCache(config=config)
    layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    cache.layers = layers
    cache.kv_store = cache.kv_store_starts = None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kv_heads = getattr(text, "num_key_value_heads", None)
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if dtype is not None and kv_heads and head_dim and layers and all(type(x) is PreallocatedLayer for x in layers):
        store = torch.empty(2 * len(layers), kv_heads, max(1, int(capacity)), head_dim, dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            layer._key_buf, layer._value_buf = store[2 * i:2 * i + 1], store[2 * i + 1:2 * i + 2]
        cache.kv_store = store
        cache.kv_store_starts = [(store[2 * i].data_ptr(), store[2 * i + 1].data_ptr()) for i in range(len(layers))]
    return cache


def _on_store(cache: DynamicCache) -> bool:
    """True while every layer's keys and values are still views of ``cache.kv_store`` (a layer that outgrew it, or
    whose tensors were replaced, has left it)."""
    starts = getattr(cache, "kv_store_starts", None)
    if starts is None:
        return False
    stride = cache.kv_store.stride()[1:]
    for layer, (k, v) in zip(cache.layers, starts):
        keys, values = layer.keys, layer.values
        if keys.data_ptr() != k or values.data_ptr() != v or keys.stride()[1:] != stride:
            return False
    return True


def keep_accepted_path(cache: DynamicCache, past_len: int, tree_size: int, path: torch.Tensor) -> None:
    """The cache holds ``past_len`` context positions followed by ``tree_size`` tree nodes. Keep the context and
    the nodes of ``path`` (increasing node indices, root first), so the cache ends at ``past_len + len(path)``.

    The accepted nodes are moved down over the tree's first slots (a gather, then a slice write), and the rest of
    the tree is cut with the public ``crop``.
    """
    kept = path.numel()
    if tree_size == kept:
        return
    moved = not torch.equal(path, torch.arange(kept, device=path.device))
    if _on_store(cache):  # all layers at once: one gather, one write, then each layer's views shortened
        store = cache.kv_store
        if moved:
            store.narrow(-2, past_len, kept).copy_(store.index_select(-2, past_len + path))
        for layer in cache.layers:
            layer.cut(past_len + kept)
        return
    if moved:
        src = past_len + path
        for layer in cache.layers:
            layer.keys[..., past_len:past_len + kept, :] = layer.keys.index_select(-2, src)
            layer.values[..., past_len:past_len + kept, :] = layer.values.index_select(-2, src)
    cache.crop(-(tree_size - kept))

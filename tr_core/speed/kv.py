"""The one place that touches KV-cache internals: a cache that grows without copying, and keeping only the accepted
path of a verified tree."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

_OWN = object()  # marks keys/values that are the first ``_length`` positions of the layer's own buffers


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are the first positions of buffers allocated for ``capacity``.

    transformers' ``DynamicLayer`` concatenates on every update, which copies the whole cache of every layer at every
    step: its cost grows with the context (for the embedded model 2 x 30 layers of keys and values per step). Here an
    update writes the new positions into the buffers; they are reallocated (at least doubled) only when full.

    ``keys``/``values`` read as views of the buffers' first ``length`` positions, made when read (``cut`` shortens a
    layer without making any). Assigning a prefix view of the buffers (as ``crop`` does) shortens the layer; assigning
    any other tensor replaces its contents, which the next ``update`` takes over into the buffers.
    """

    def __init__(self, capacity: int = 256):
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None
        self._length = [0, 0]  # positions held by the key and the value buffer (equal, but set one at a time)
        self._views: list[torch.Tensor | None] = [None, None]
        self._ext: list = [None, None]  # keys/values given from outside, or _OWN
        # the fewest positions the buffers have held unchanged since ``tiles_for`` last looked (a cut lowers it; new
        # contents make it 0): positions below it still hold what the AMX tiles were laid from
        self.shortest = 0
        super().__init__()
        self.capacity = max(1, int(capacity))

    def _buffer(self, which: int) -> torch.Tensor | None:
        return self._key_buf if which == 0 else self._value_buf

    def _get(self, which: int):
        if self._ext[which] is not _OWN:
            return self._ext[which]
        view = self._views[which]
        if view is None or view.shape[-2] != self._length[which]:
            view = self._views[which] = self._buffer(which).narrow(-2, 0, self._length[which])
        return view

    def _set(self, which: int, value) -> None:
        buf = self._buffer(which)
        if (buf is not None and isinstance(value, torch.Tensor) and value.data_ptr() == buf.data_ptr()
                and value.stride() == buf.stride() and value.shape[:-2] == buf.shape[:-2]
                and value.shape[-1] == buf.shape[-1]):  # a prefix of the buffer, as crop() makes
            self._ext[which], self._length[which] = _OWN, value.shape[-2]
            self.shortest = min(self.shortest, value.shape[-2])
        else:
            self._ext[which], self.shortest = value, 0

    keys = property(lambda self: self._get(0), lambda self, value: self._set(0, value))
    values = property(lambda self: self._get(1), lambda self, value: self._set(1, value))

    def owns(self) -> bool:
        """True while keys and values are the buffers' own first positions."""
        return self._ext[0] is _OWN and self._ext[1] is _OWN and self._length[0] == self._length[1]

    def get_seq_length(self) -> int:
        if self.owns():
            return self._length[0]
        return super().get_seq_length()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        key_buf, value_buf, length = self.extend(key_states)
        end = self._length[0]
        # narrow() rather than [..., a:b, :]: a few microseconds less per call, 60 calls a step
        key_buf.narrow(-2, length, end - length).copy_(key_states)
        value_buf.narrow(-2, length, end - length).copy_(value_states)
        return self._get(0), self._get(1)

    def extend(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Make room for ``like``'s positions (its shape, dtype and device: (..., new positions, head dim)) after
        the ones held, and count them as held: returns the key and value buffers and the first new position, which
        the caller fills (``update`` copies ``like``-shaped states there; the native forward writes them)."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
        if self.owns():
            length = self._length[0]
        else:  # empty, or contents given from outside: into the buffers
            keys, values = self.keys, self.values
            length = keys.shape[-2] if keys is not None and keys.numel() else 0
            self._reserve(0 if length == 0 else -1, length + like.shape[-2], like)
            if length:
                self._key_buf.narrow(-2, 0, length).copy_(keys)
                self._value_buf.narrow(-2, 0, length).copy_(values)
            self._ext, self.shortest = [_OWN, _OWN], 0
        end = length + like.shape[-2]
        self._reserve(length, end, like)  # returns at once where the buffers fit like's positions, shape and dtype
        self._length = [end, end]
        return self._key_buf, self._value_buf, length

    def _reserve(self, length: int, needed: int, like: torch.Tensor) -> None:
        """Make the buffers hold ``needed`` positions of ``like``'s shape, dtype and device, keeping the first
        ``length`` positions (-1: none, and new buffers even if the old ones fit: they may be shared)."""
        buf = self._key_buf
        if length >= 0 and buf is not None and needed <= buf.shape[-2] and (
                buf.shape[:-2], buf.shape[-1], buf.dtype, buf.device) == (
                like.shape[:-2], like.shape[-1], like.dtype, like.device):
            return  # fits (an empty layer with buffers given in advance by new_cache, too)
        old = self._key_buf.shape[-2] if self._key_buf is not None else 0
        grown = 2 * old if needed > old else old  # doubled when full; kept where only the dtype or shape changed
        shape = (*like.shape[:-2], max(needed, self.capacity, grown), like.shape[-1])
        if length > 0 and (buf.shape[:-2], buf.shape[-1]) != (like.shape[:-2], like.shape[-1]):
            raise ValueError(f"states of shape {tuple(like.shape)} do not go on a cache of {tuple(buf.shape)}")
        key_buf, value_buf = like.new_empty(shape), like.new_empty(shape)
        if length > 0:
            key_buf.narrow(-2, 0, length).copy_(self._key_buf.narrow(-2, 0, length))
            value_buf.narrow(-2, 0, length).copy_(self._value_buf.narrow(-2, 0, length))
        self._key_buf, self._value_buf, self._views, self.shortest = key_buf, value_buf, [None, None], 0

    def cut(self, length: int) -> None:
        """Keep the first ``length`` positions (the layer must ``own`` its contents); no view is made."""
        self._length = [length, length]
        self.shortest = min(self.shortest, length)

    def reset(self) -> None:
        self._key_buf = self._value_buf = None
        self._views, self._length, self.shortest = [None, None], [0, 0], 0
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
    cache.kv_store = cache.kv_store_starts = None  # starts: each layer's buffers in the store
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kv_heads = getattr(text, "num_key_value_heads", None)
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if dtype is not None and kv_heads and head_dim and layers and all(type(x) is PreallocatedLayer for x in layers):
        store = torch.empty(2 * len(layers), kv_heads, max(1, int(capacity)), head_dim, dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            layer._key_buf, layer._value_buf = store[2 * i:2 * i + 1], store[2 * i + 1:2 * i + 2]
        cache.kv_store = store
        cache.kv_store_starts = [(layer._key_buf, layer._value_buf) for layer in layers]
    return cache


def _store_length(cache: DynamicCache) -> int | None:
    """The positions every layer holds, where all of them still hold their keys and values in ``cache.kv_store``
    and hold the same number; else None (a layer that outgrew the store, or whose tensors were replaced, has left
    it)."""
    starts = getattr(cache, "kv_store_starts", None)
    if starts is None:
        return None
    length = cache.layers[0]._length[0]
    for layer, (k, v) in zip(cache.layers, starts):  # a layer's buffers are replaced, never changed, when it grows
        if not (layer._key_buf is k and layer._value_buf is v and layer.owns() and layer._length[0] == length):
            return None
    return length


def extend_on_store(cache: DynamicCache, n: int) -> tuple[int, torch.Tensor] | None:
    """``n`` more positions counted in every layer at once, where all of them hold their keys and values in
    ``cache.kv_store`` with one length (``_store_length``) and it has room for ``n`` more: returns the
    first new position and, per layer, the addresses of its key and value buffers and their floats per kv head (an
    int64 (layers, 3) tensor, made once per store), which the caller fills as ``PreallocatedLayer.extend``'s. Else
    None, with nothing changed (``extend`` each layer)."""
    past = _store_length(cache)
    store = cache.kv_store
    if past is None or past + n > store.shape[-2]:
        return None
    for layer in cache.layers:
        layer._length = [past + n, past + n]
    held = getattr(cache, "kv_pointers", None)
    if held is None or held[0] != store.data_ptr():
        rows = [(k.data_ptr(), v.data_ptr(), k.stride(1)) for k, v in cache.kv_store_starts]
        held = cache.kv_pointers = (store.data_ptr(), torch.tensor(rows, dtype=torch.int64))
    return past, held[1]


TILED = 64  # the positions the AMX tiles of the keys and values are laid in at once (native.c's kv_tiles64)


def tiles_for(cache: DynamicCache, start: int) -> tuple[torch.Tensor, int, int]:
    """The AMX tiles of the keys and values before a step's window, which the amx format's attention reads (native.c's
    ``attend_amx``: bf16, laid out as tile products take them), kept with a cache whose layers all hold their keys and
    values in ``cache.kv_store`` (``extend_on_store`` found them there), half its size. Returns per layer the address
    of its tiles (int64 (layers,)), the positions they are made for (the store's), and the first position still to be
    laid: the tiles below it were laid from the contents the buffers still hold (no layer was cut below it, nor given
    new contents, since: ``PreallocatedLayer.shortest``); the call lays them from there to ``start``, the window's
    start, and the tiles count as laid up to it from then on."""
    store = cache.kv_store
    layers, kv_heads, capacity, dim = len(cache.layers), store.shape[1], store.shape[2], store.shape[3]
    held = getattr(cache, "kv_tiles", None)
    if held is None or held[0] != store.data_ptr():  # bf16 tiles, as many values as the store's keys
        tiles = torch.empty(layers, kv_heads, 2, capacity, dim, dtype=torch.bfloat16, device=store.device)
        held = cache.kv_tiles = [store.data_ptr(), tiles, torch.tensor([t.data_ptr() for t in tiles]), 0]
    laid = min(held[3], min(layer.shortest for layer in cache.layers) // TILED * TILED)
    for layer in cache.layers:
        layer.shortest = layer._length[0]
    held[3] = max(laid, start)
    return held[2], capacity, min(laid, start)


def keep_accepted_path(cache: DynamicCache, past_len: int, tree_size: int, path: torch.Tensor) -> None:
    """The cache holds ``past_len`` context positions followed by ``tree_size`` tree nodes. Keep the context and
    the nodes of ``path`` (increasing node indices, root first), so the cache ends at ``past_len + len(path)``.

    The accepted nodes are moved down over the tree's first slots (a gather, then a slice write), and the rest of
    the tree is cut: for all layers at once where they share ``cache.kv_store``, else layer by layer with the public
    ``crop``.
    """
    kept = path.numel()
    if tree_size == kept:
        return
    moved = path.tolist() != list(range(kept))
    if moved:  # positions from past_len on are written over: what the AMX tiles were laid from ends there
        for layer in cache.layers:
            if hasattr(layer, "shortest"):
                layer.shortest = min(layer.shortest, past_len)
    if _store_length(cache) is not None:  # all layers at once: one gather, one write, then each layer's views cut
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

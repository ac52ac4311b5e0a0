"""The preallocated KV cache: grows without copying, keeps only the accepted path, in one gather where it can."""

import pytest
import torch
from conftest import tiny_model

from tr_core.speed.kv import PreallocatedLayer, _store_length, extend_on_store, keep_accepted_path, new_cache


def test_preallocated_cache_grows_crops_and_adopts_replaced_tensors():
    cache = new_cache(tiny_model("llama").config, 4)
    layer = cache.layers[0]
    assert isinstance(layer, PreallocatedLayer)
    # 3 positions each, position p holding p: past the capacity of 4, so it reallocates
    rows = [torch.arange(3 * i, 3 * i + 3, dtype=torch.float32).view(1, 1, 3, 1).expand(1, 2, 3, 8) for i in range(3)]
    for r in rows:
        for each in cache.layers:
            each.update(r, r + 100)
    assert layer.keys[0, 1, :, 3].tolist() == list(range(9)) and \
        layer.values[0, 0, :, 0].tolist() == list(range(100, 109))
    buffer = layer._key_buf
    # a 3-node tree after 6 context positions, whose path keeps nodes 0 and 2: written in place, then cut
    keep_accepted_path(cache, 6, 3, torch.tensor([0, 2]))
    assert layer.keys.shape[-2] == 8 and layer._key_buf is buffer
    assert layer.keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 8]  # node 2 (position 8) moved down to 7
    layer.update(torch.full((1, 2, 1, 8), 9.0), torch.full((1, 2, 1, 8), 9.0))
    assert layer.keys.shape[-2] == 9 and layer._key_buf is buffer and float(layer.keys[0, 0, 8, 0]) == 9.0
    # tensors replaced from outside are taken over, not silently overwritten
    layer.keys, layer.values = layer.keys[..., :2, :].clone(), layer.values[..., :2, :].clone()
    layer.update(torch.full((1, 2, 1, 8), 7.0), torch.full((1, 2, 1, 8), 7.0))
    assert layer.keys[0, 0, :, 0].tolist() == [0.0, 1.0, 7.0] and layer._key_buf is not buffer


def _filled(cache, n):
    g = torch.Generator().manual_seed(1)
    for layer in cache.layers:
        k, v = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
        layer.update(k, v)
    return cache


def test_one_store_for_all_layers_keeps_the_same_path_as_layer_by_layer():
    config = tiny_model("llama").config  # 2 layers, 2 key/value heads, head dim 16
    on_store = _filled(new_cache(config, 64, torch.float32), 20)
    per_layer = _filled(new_cache(config, 64), 20)
    assert _store_length(on_store) == 20 and _store_length(per_layer) is None
    store = on_store.kv_store
    assert store.shape == (4, 2, 64, 16)
    path = torch.tensor([0, 2, 5])  # a 7-node tree after 13 context positions
    for cache in (on_store, per_layer):
        keep_accepted_path(cache, 13, 7, path)
    for a, b in zip(on_store.layers, per_layer.layers):
        assert a.keys.shape[-2] == 16 and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert on_store.kv_store is store and _store_length(on_store) == 16
    # a layer whose tensors were replaced from outside leaves the store; the cache then keeps paths layer by layer
    layer = on_store.layers[1]
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
    for cache in (on_store, per_layer):
        for each in cache.layers:
            each.update(torch.ones(1, 2, 4, 16), torch.ones(1, 2, 4, 16))
        assert cache.layers[1].keys.shape[-2] == 20
    assert _store_length(on_store) is None
    for cache in (on_store, per_layer):
        keep_accepted_path(cache, 16, 4, torch.tensor([0, 3]))
    for a, b in zip(on_store.layers, per_layer.layers):
        assert a.keys.shape[-2] == 18 and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_extend_on_store_counts_the_rows_in_every_layer_as_extend_does():
    config = tiny_model("llama").config  # 2 layers, 2 key/value heads, head dim 16
    fast, each = (_filled(new_cache(config, 24, torch.float32), 20) for _ in range(2))
    past, pointers = extend_on_store(fast, 3)
    held = [layer.extend(torch.empty(1, 2, 3, 16)) for layer in each.layers]
    assert past == 20 and {start for _, _, start in held} == {20}
    assert [layer.get_seq_length() for layer in fast.layers] == [layer.get_seq_length() for layer in each.layers]
    store = fast.kv_store  # the addresses handed out are the layers' own buffers in the store
    expected = [(layer._key_buf.data_ptr(), layer._value_buf.data_ptr(), 24 * 16) for layer in fast.layers]
    assert pointers.tolist() == [list(row) for row in expected] and pointers.dtype == torch.int64
    assert expected[0][0] == store.data_ptr() and extend_on_store(fast, 1)[1] is pointers  # made once per store
    # full (24 positions): no room for one more, and nothing changes (the layer-by-layer extend reallocates)
    assert extend_on_store(fast, 1) is None and [layer.get_seq_length() for layer in fast.layers] == [24, 24]
    # layers of different lengths, or a layer off the store: None
    fast.layers[1].cut(22)
    assert extend_on_store(fast, 1) is None
    assert extend_on_store(_filled(new_cache(config, 64), 5), 1) is None


def test_extend_hands_out_room_and_refits_buffers_that_do_not_match():
    layer = PreallocatedLayer(capacity=8)
    keys = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)
    layer.update(keys, -keys)
    key_buf, value_buf, start = layer.extend(torch.empty(1, 2, 2, 4))
    assert start == 3 and layer.get_seq_length() == 5 and key_buf.shape == (1, 2, 8, 4)
    key_buf[:, :, 3:5] = 7.0  # the caller writes the new positions
    assert torch.equal(layer.keys[:, :, :3], keys) and (layer.keys[:, :, 3:] == 7).all()
    # another dtype: new buffers of the same capacity (not doubled: they were not full), the contents converted
    key_buf, _, start = layer.extend(torch.empty(1, 2, 1, 4, dtype=torch.float64))
    assert key_buf.dtype == torch.float64 and key_buf.shape == (1, 2, 8, 4) and start == 5
    assert torch.equal(layer.keys[:, :, :3], keys.double())
    with pytest.raises(ValueError, match="do not go on a cache"):  # another batch: refused, not broadcast
        layer.extend(torch.empty(3, 2, 1, 4, dtype=torch.float64))

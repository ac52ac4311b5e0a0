"""Fixed-shape attention: every row of every forward reads the keys plain decoding would read, in its order, and
the cache is read once a pass, not once a row.

A run of the torch backend computes every forward pass over ``R`` query rows (the draft's nodes, padded) and, in
attention, over ``C`` cache slots. All layers' keys and values live in one static tensor ``kv``
(layers, 2, kv heads, S, head dim) with ``S = C + R + 1``:

    slots [0, C)        the cache: position p's key at slot p
    slots [C, C + R)    this pass's rows (row r's key at slot C + r)
    slot  S - 1         zeros: what a row's unused slots read

A row at position ``p`` sees positions ``0 .. p``, split at ``start = past // WINDOW * WINDOW`` (``past``: the
cached positions; every row of a pass shares it) into

- the *shared* part, positions ``0 .. start - 1``: all in the cache, the same for every row. Every row's scores
  against all ``S`` slots are one matrix product that reads the keys in place, once; the shared part's weighted
  values are one product that reads the cached values in place, once.
- the row's *own window*, ``WINDOW`` offsets ``position - start``: the window's cached keys (``start .. past - 1``),
  then the row's ancestors, root first, itself last, then nothing. Its scores are picked out of the product above;
  its values are the one thing gathered per row (``WINDOW`` of them, not the ``C`` of the cache).

Each row's softmax runs over its ``C`` shared scores then its ``WINDOW`` own ones, in one fixed layout. Plain
decoding of the same token has the same ``start`` and fills the window with the same keys at the same offsets, so at
the run's fixed shapes every sum has the same terms in the same places, whatever other rows go with it: a row's
numbers depend on its own inputs only, on any device. The price: a pass's rows must lie in one window, so the
decoding loop cuts a draft's depth at the window's end (``FixedRun.room``) and the prefill goes in chunks that do
not cross one. After the pass the accepted rows are copied to slots ``past .. past + a`` (``compact``).

    >>> index, valid = key_slots(torch.tensor(2), torch.tensor([[1, 0], [1, 1]], dtype=torch.bool), slots=5)
    >>> index[:, :4].tolist(), valid[:, :4].tolist()
    ([[0, 1, 5, 7], [0, 1, 5, 6]], [[True, True, True, False], [True, True, True, True]])

(With ``C`` = 5 and ``past`` = 2, the window starts at 0: row 0's window is the cache's two slots and itself, row 1's
those and its parent, row 0, then itself; 7 is the zero slot.)
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

NAME = "tr_fixed_rows"  # the attention implementation registered with transformers
WINDOW = 64  # positions a row's own window holds: the deepest a pass may reach past its first row, plus one


def window_start(past: int) -> int:
    """Where the window of a pass on ``past`` cached positions begins: ``window_start(130) -> 128``."""
    return past // WINDOW * WINDOW


def window_room(past: int) -> int:
    """How many positions after ``past`` still lie in its window (the deepest draft node a pass may verify):
    ``window_room(128) -> 63``, ``window_room(191) -> 0``."""
    return window_start(past) + WINDOW - 1 - past


def key_slots(past: torch.Tensor, visible: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's own window (R, WINDOW): the slot of the key at each offset, and whether the row attends it, from
    the cached length ``past`` (a 0-d tensor on the device) and ``visible`` (R, R): row r sees row j (its ancestors
    and itself, in row order = depth order). ``slots`` = C. Tensor operations only (no host sync), so a CUDA graph
    can hold them."""
    rows = visible.shape[0]
    zero = slots + rows
    start = past // WINDOW * WINDOW
    cached = start + torch.arange(WINDOW, device=visible.device)
    index = torch.where(cached < past, cached, zero).expand(rows, WINDOW).clone()
    # ancestor j of row r goes to offset past - start + (its depth: the visible rows before it); others are dropped
    offset = past - start + visible.long().cumsum(1) - 1
    target = torch.where(visible, offset.clamp(max=WINDOW), WINDOW)
    own = slots + torch.arange(rows, device=visible.device).expand(rows, rows)
    index = torch.cat([index, torch.full_like(index[:, :1], zero)], dim=1).scatter(1, target, own)[:, :WINDOW]
    return index, index != zero


def bytes_a_pass(layers: int, kv_heads: int, head_dim: int, rows: int, slots: int, item: int) -> dict[str, int]:
    """The bytes attention moves in one pass, from the shapes (``item``: bytes a number): the cache's keys and
    values read once (``cache``), and each row's window of values gathered (written, then read: ``windows``).

    >>> bytes_a_pass(30, 3, 64, 88, 1024, 2)
    {'cache': 23592960, 'windows': 129761280}
    """
    return {"cache": layers * 2 * kv_heads * slots * head_dim * item,
            "windows": layers * 2 * kv_heads * rows * WINDOW * head_dim * item}


class RowsState:
    """The static buffers of one run (``kv`` and the pass's inputs), read by ``fixed_rows_attention`` through the
    forward's keyword ``tr_rows``."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, rows: int, dtype: torch.dtype,
                 device: torch.device):
        self.slots, self.rows = slots, rows
        self.kv = torch.zeros(layers, 2, kv_heads, slots + rows + 1, head_dim, dtype=dtype, device=device)
        self.index = torch.zeros(rows, WINDOW, dtype=torch.long, device=device)
        self.mask = torch.zeros(rows, slots + WINDOW, dtype=torch.bool, device=device)  # shared slots, then window
        self._column = torch.arange(slots, device=device)

    def set_slots(self, past: torch.Tensor, visible: torch.Tensor) -> None:
        index, valid = key_slots(past, visible, self.slots)
        self.index.copy_(index)
        self.mask[:, :self.slots] = self._column < past // WINDOW * WINDOW
        self.mask[:, self.slots:] = valid

    def compact(self, past: int, path: torch.Tensor) -> None:
        """Move the accepted rows ``path`` (a + 1,) into the cache's slots past .. past + a."""
        src = self.slots + path.to(self.kv.device)
        self.kv[:, :, :, past:past + src.numel()] = self.kv[:, :, :, src]


def fixed_rows_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                         scaling: float, dropout: float = 0.0, tr_rows: RowsState | None = None, **kwargs):
    """transformers' attention interface over a ``RowsState``: ``query`` (1, heads, R, d), ``key``/``value``
    (1, kv heads, R, d) of this pass's rows, after the rotary embedding; returns (1, R, heads, d) and no weights.
    Scores and softmax in fp32. Without ``tr_rows`` (the model called outside a run), transformers' SDPA attention;
    no mask function is registered for this implementation (building one costs a pass time and host syncs a CUDA
    graph cannot hold), so such a call attends causally from the first position, as a forward over a whole sequence
    does."""
    if tr_rows is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # only for calls outside a run
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    state = tr_rows
    store = state.kv[module.layer_idx]  # (2, kv heads, S, d)
    rows, slots = state.rows, state.slots
    store[0, :, slots:slots + rows] = key[0]
    store[1, :, slots:slots + rows] = value[0]
    kv_heads, head_dim = store.shape[1], store.shape[-1]
    group = query.shape[1] // kv_heads
    q = query[0].view(kv_heads, group, rows, head_dim).transpose(1, 2).reshape(kv_heads, rows * group, head_dim)
    every = torch.matmul(q, store[0].transpose(-1, -2)).view(kv_heads, rows, group, -1)  # the keys read once
    own = every.gather(3, state.index[None, :, None, :].expand(kv_heads, rows, group, WINDOW))
    scores = torch.cat([every[..., :slots], own], dim=-1).float() * scaling  # (kv heads, R, group, C + WINDOW)
    scores = scores.masked_fill(~state.mask[None, :, None, :], float("-inf"))
    probs = F.softmax(scores, dim=-1).to(value.dtype)
    shared = torch.matmul(probs[..., :slots].reshape(kv_heads, rows * group, slots), store[1, :, :slots])
    out = shared.view(kv_heads, rows, group, head_dim) + torch.matmul(probs[..., slots:], store[1][:, state.index])
    return out.permute(1, 0, 2, 3).reshape(1, rows, kv_heads * group, head_dim), None


def use_for(model) -> None:
    """Make ``model`` attend with ``fixed_rows_attention`` (registered with transformers once)."""
    from transformers import AttentionInterface  # transformers' registry, loaded only where a model uses the backend

    AttentionInterface.register(NAME, fixed_rows_attention)
    model.config._attn_implementation = NAME
    for sub in model.modules():  # sub-configs (a multimodal model's text part) read their own
        config = getattr(sub, "config", None)
        if config is not None and config is not model.config and hasattr(config, "_attn_implementation"):
            config._attn_implementation = NAME

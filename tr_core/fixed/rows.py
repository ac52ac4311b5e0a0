"""Fixed-shape attention: every row of every forward reads the keys plain decoding would read, in its order.

A run of the torch backend computes every forward pass over ``R`` query rows (the draft's nodes, padded) and, in
attention, over ``C`` key slots per row. All layers' keys and values live in one static tensor ``kv``
(layers, 2, kv heads, S, head dim) with ``S = C + R + 1``:

    slots [0, C)        the cache: position p's key at slot p
    slots [C, C + R)    this pass's rows (row r's key at slot C + r)
    slot  S - 1         zeros: what a row's unused slots read

Row r at depth d on top of ``past`` cached positions reads, in slot order, the cache's slots 0 .. past - 1, then its
ancestors' rows (root first, itself last) in slots past .. past + d, then zeros: exactly the keys of plain decoding
at its position, in the same slots, whatever other rows go with it. Its numbers so depend on its own inputs only, on
any device: a GPU's blocked reductions see the same values in the same places. After the pass the accepted rows are
copied to slots past .. past + a (``compact``).

    >>> index, valid = key_slots(torch.tensor(2), torch.tensor([[1, 0], [1, 1]], dtype=torch.bool), slots=5)
    >>> index.tolist(), valid.tolist()
    ([[0, 1, 5, 7, 7], [0, 1, 5, 6, 7]], [[True, True, True, False, False], [True, True, True, True, False]])

(With ``C`` = 5: row 0 reads the cache's two slots and itself, row 1 those and its parent, row 0, then itself; 7 is
the zero slot.)
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

NAME = "tr_fixed_rows"  # the attention implementation registered with transformers


def key_slots(past: torch.Tensor, visible: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's key slots (R, C) and which of them it attends (R, C), from the cached length ``past`` (a 0-d
    tensor on the device) and ``visible`` (R, R): row r sees row j (its ancestors and itself, in row order = depth
    order). ``slots`` = C. Tensor operations only (no host sync), so a CUDA graph can hold them."""
    rows = visible.shape[0]
    zero = slots + rows
    column = torch.arange(slots, device=visible.device)
    index = torch.where(column < past, column, zero).expand(rows, slots).clone()
    # ancestor j of row r goes to slot past + (number of visible rows before j); the others to a dropped column
    offset = past + visible.long().cumsum(1) - 1
    target = torch.where(visible, offset.clamp(max=slots), slots)
    own = slots + torch.arange(rows, device=visible.device).expand(rows, rows)
    index = torch.cat([index, torch.full_like(index[:, :1], zero)], dim=1).scatter(1, target, own)[:, :slots]
    return index, index != zero


class RowsState:
    """The static buffers of one run (``kv`` and the pass's inputs), read by ``fixed_rows_attention`` through the
    forward's keyword ``tr_rows``."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, rows: int, dtype: torch.dtype,
                 device: torch.device):
        self.slots, self.rows = slots, rows
        self.kv = torch.zeros(layers, 2, kv_heads, slots + rows + 1, head_dim, dtype=dtype, device=device)
        self.index = torch.zeros(rows, slots, dtype=torch.long, device=device)
        self.valid = torch.zeros(rows, slots, dtype=torch.bool, device=device)

    def set_slots(self, past: torch.Tensor, visible: torch.Tensor) -> None:
        index, valid = key_slots(past, visible, self.slots)
        self.index.copy_(index)
        self.valid.copy_(valid)

    def compact(self, past: int, path: torch.Tensor) -> None:
        """Move the accepted rows ``path`` (a + 1,) into the cache's slots past .. past + a."""
        src = self.slots + path.to(self.kv.device)
        self.kv[:, :, :, past:past + src.numel()] = self.kv[:, :, :, src]


def fixed_rows_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                         scaling: float, dropout: float = 0.0, tr_rows: RowsState | None = None, **kwargs):
    """transformers' attention interface over a ``RowsState``: ``query`` (1, heads, R, d), ``key``/``value``
    (1, kv heads, R, d) of this pass's rows, after the rotary embedding; returns (1, R, heads, d) and no weights.
    Scores and softmax in fp32; each (kv head, row) pair is its own batch entry of one batched product.
    Without ``tr_rows`` (the model called outside a run), transformers' SDPA attention; no mask function is
    registered for this implementation (building one costs a pass time and host syncs a CUDA graph cannot hold), so
    such a call attends causally from the first position, as a forward over a whole sequence does."""
    if tr_rows is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    state = tr_rows
    store = state.kv[module.layer_idx]  # (2, kv heads, S, d)
    rows, slots = state.rows, state.slots
    store[0, :, slots:slots + rows] = key[0]
    store[1, :, slots:slots + rows] = value[0]
    keys = store[0][:, state.index]  # (kv heads, R, C, d)
    values = store[1][:, state.index]
    kv_heads, head_dim = keys.shape[0], keys.shape[-1]
    group = query.shape[1] // kv_heads
    q = query[0].view(kv_heads, group, rows, head_dim).transpose(1, 2)  # (kv heads, R, group, d)
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scaling  # (kv heads, R, group, C)
    scores = scores.masked_fill(~state.valid[None, :, None, :], float("-inf"))
    probs = F.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # (kv heads, R, group, d)
    return out.permute(1, 0, 2, 3).reshape(1, rows, kv_heads * group, head_dim), None


def use_for(model) -> None:
    """Make ``model`` attend with ``fixed_rows_attention`` (registered with transformers once)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, fixed_rows_attention)
    model.config._attn_implementation = NAME
    for sub in model.modules():  # sub-configs (a multimodal model's text part) read their own
        config = getattr(sub, "config", None)
        if config is not None and config is not model.config and hasattr(config, "_attn_implementation"):
            config._attn_implementation = NAME

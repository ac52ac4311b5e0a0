"""Attention whose every row comes out bit for bit the same, whatever rows are computed with it.

A token's logits must not depend on whether it is verified alone (a plain step), as a node of a draft tree of any
size, or inside a prefill chunk: otherwise a float near-tie decides differently in a tree than in plain decoding,
and the output is no longer plain decoding's. torch's fused attention kernels are not like that: the same query row
gives other bits when the batch of rows, the number of keys, or the masked keys between its own keys change
(their reductions and block sizes follow the shapes). So attention is computed here from operations whose result
per row depends only on that row's inputs, on a fixed layout of the keys:

- A row at position ``p`` sees positions ``0 .. p``. They are split at ``start = (p // BLOCK) * BLOCK``: the keys
  before ``start`` (the *shared* part: all in the cache, and the same for every row of a step) and the at most
  ``BLOCK`` keys from ``start`` to ``p`` (the row's *own* part, laid out at fixed offsets ``position - start`` in a
  window of ``BLOCK``: the cached keys of the window, then the row's tree ancestors or earlier chunk rows, then
  padding). Plain decoding of the same token splits at the same ``start`` and fills the window with the same keys
  at the same offsets, so every sum below has the same terms in the same order.
- Scores and the shared part's weighted values are batched matrix products, per kv head, of the step's queries
  (its rows times the query heads of that kv head) by the keys, computed so that an entry's result does not depend
  on how many rows or keys there are (``KINDS``: ``torch.bmm`` on at least a few rows and ``BLOCK`` keys, zeros
  added, or oneDNN's matmul); the own part's weighted values are a batched product with a fixed shape per row
  (``bmm``: query heads x BLOCK by BLOCK x head_dim). The softmax is taken over one row per query, its shared scores
  then its window's (one maximum, one sum, over ``start + BLOCK`` entries laid out alike for every row), in fp32.
- Where the C library is built (``native.py``), the same layout is computed in one call, ``tr_attend``: each (row,
  query head) by one thread alone, its scores, softmax and weighted values in a fixed order, so it is row-invariant by
  construction (measured against torch's operations: docs/speed.md, "The whole pass in one C call").
- Rows of one call must lie in one window (``row_keys`` raises otherwise): the decoding loop cuts a draft tree's
  depth at the window's end (``window_room``) and prefills in chunks aligned to ``BLOCK``.

``batch_invariant(heads, kv_heads, head_dim)`` checks on this machine, once per process and shape, which way of
computing the products makes every row (chains and trees, 1 to 81 rows, short and long contexts) come out the same as
alone; where none does, the lean forward keeps torch's fused attention and the mode says so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from . import native

BLOCK = 64  # positions per window: a row's own part is at most this many keys


class WindowError(ValueError):
    """Rows of one forward pass that do not lie in one window of ``BLOCK`` positions."""


@dataclass(frozen=True)
class RowKeys:
    """Which keys each of ``n`` new rows attends to: every key before ``start`` (cached), and its own window:
    ``index`` (n, BLOCK) int64, the key at each offset ``position - start`` (an index into the layer's keys after
    the step's keys were appended: cached keys first, then the step's rows in order), valid where ``valid`` (n,
    BLOCK) bool."""

    start: int
    index: torch.Tensor
    valid: torch.Tensor
    group: int = 1  # query heads per kv head: ``grouped`` repeats each row this many times
    keys: int = 0  # how many keys the layer holds once the step's are appended (every index is below it)

    def __post_init__(self):
        object.__setattr__(self, "buffers", {})  # attend's scratch buffers, shared by the layers of one pass

    # made once per forward pass where torch's operations read them (the native calls do not), used by every layer:
    # the window's keys flattened, and ``index`` and ``~valid`` with each row repeated ``group`` times (its query
    # heads of one kv head)
    @functools.cached_property
    def flat(self) -> torch.Tensor:
        return self.index.flatten()

    @functools.cached_property
    def grouped(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.index.repeat_interleave(self.group, 0), ~self.valid.repeat_interleave(self.group, 0)


def window_start(position: int) -> int:
    """``window_start(130) -> 128``: where the window of the row at ``position`` begins."""
    return position // BLOCK * BLOCK


def window_room(past: int) -> int:
    """How many positions after ``past`` (the first new row's position) still lie in its window: the deepest draft
    node one step may verify. ``window_room(128) -> 63``, ``window_room(191) -> 0``."""
    return window_start(past) + BLOCK - 1 - past


def row_keys(past: int, positions: torch.Tensor, visible: torch.Tensor | None, group: int = 1) -> RowKeys:
    """The key layout of ``n`` new rows on top of ``past`` cached positions. ``positions`` (n,) int64: each row's
    position; ``visible`` (n, n) bool: which of the step's rows each row sees (itself and its ancestors in a tree),
    None for a causal chain (each sees the rows before it and itself). Each row must see exactly one row at each
    position from ``past`` to its own. ``group``: query heads per kv head (``attend`` reads its rows so laid out).

    >>> keys = row_keys(66, torch.tensor([66, 67, 67]), torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]]).bool())
    >>> keys.start, keys.index[:, :5].tolist()
    (64, [[64, 65, 66, 0, 0], [64, 65, 66, 67, 0], [64, 65, 66, 68, 0]])
    >>> keys.valid[:, :5].int().tolist()
    [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 0]]
    """
    n = positions.numel()
    device = positions.device
    lo, hi = int(positions.min()), int(positions.max())
    start = window_start(past)
    if lo < past or hi >= start + BLOCK:
        raise WindowError(f"rows at positions {lo}..{hi} on {past} cached ones: a forward pass's rows must lie in "
                          f"one window of {BLOCK} positions ({start}..{start + BLOCK - 1})")
    cached = past - start
    if n == 1 and visible is None and lo == past:  # a plain step: its window's cached keys, then its own (as below)
        index, valid = _plain_rows(start, str(device))
        return RowKeys(start, index[cached:cached + 1], valid[cached:cached + 1], group, past + 1)
    index = torch.zeros(n, BLOCK, dtype=torch.long, device=device)
    valid = torch.zeros(n, BLOCK, dtype=torch.bool, device=device)
    if cached:
        index[:, :cached] = torch.arange(start, past, device=device)
        valid[:, :cached] = True
    if visible is None:
        visible = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    rows, cols = visible.nonzero(as_tuple=True)
    offsets = positions[cols] - start
    index[rows, offsets] = past + cols
    valid[rows, offsets] = True
    return RowKeys(start, index, valid, group, past + n)


@functools.lru_cache(maxsize=64)
def _plain_rows(start: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Every plain step's key layout in the window at ``start``: row ``c`` is the row at position ``start + c``
    (``row_keys``' layout: the window's keys ``start .. start + c``, zeros after them), made once per window and
    read as views (a plain step then makes no tensor of its own; nothing writes into a ``RowKeys``)."""
    valid = torch.ones(BLOCK, BLOCK, dtype=torch.bool, device=device).tril()
    index = torch.arange(start, start + BLOCK, device=device).expand(BLOCK, BLOCK) * valid
    return index.contiguous(), valid


def _onednn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The same product by oneDNN's linear kernel, one head at a time (``b`` read as a transposed weight)."""
    return torch.stack([torch.ops.mkldnn._linear_pointwise(a[h].contiguous(), b[h].t(), None, "none", [], "")
                        for h in range(a.shape[0])])


# The ways to compute attention's products, in order of preference (fewest calls first); ``batch_invariant`` picks the
# first whose rows come out the same here. (kind -> (product, the rows it runs on at least: BLAS kernels pick their
# code path by the shape, and past a few rows the path, and so a row's result, stays; zero rows are added up to it))
KINDS = {"bmm-4": (torch.bmm, 4), "bmm-16": (torch.bmm, 16), "onednn": (_onednn, 2)}


class _Scratch:
    """Zeroed fp32 buffers kept with a ``RowKeys`` for all layers of one forward pass, and the views of them every
    layer uses: each layer overwrites the step's ``m`` leading rows, and the rows after them stay zero (the padding
    the products run on). ``queries`` (Hkv, padded, D) and its step rows as (Hkv, n, group, D); of the weights
    (Hkv, padded, start + BLOCK: the scores, then the softmax's weights), the step's rows ``step``, their shared part
    ``shared`` and window ``own``, and ``padded_shared`` (all rows' shared part, the shared product's input). The
    weights are made where torch's products first read them (the native calls use only the queries)."""

    def __init__(self, kv_heads: int, n: int, group: int, dim: int, padded: int, start: int, device):
        self.m, self.start, self.device = n * group, start, device
        self.queries = torch.zeros(kv_heads, padded, dim, dtype=torch.float32, device=device)
        self.step_queries = self.queries[:, :self.m].view(kv_heads, n, group, dim)

    @functools.cached_property
    def _weights(self) -> torch.Tensor:
        kv_heads, padded = self.queries.shape[:2]
        return torch.zeros(kv_heads, padded, self.start + BLOCK, dtype=torch.float32, device=self.device)

    @functools.cached_property
    def step(self) -> torch.Tensor:
        return self._weights[:, :self.m]

    @functools.cached_property
    def shared(self) -> torch.Tensor:
        return self.step[:, :, :self.start]

    @functools.cached_property
    def own(self) -> torch.Tensor:
        return self.step[:, :, self.start:]

    @functools.cached_property
    def padded_shared(self) -> torch.Tensor:
        return self._weights[:, :, :self.start]


def scratch_for(rows: RowKeys, kv_heads: int, n: int, group: int, dim: int, padded: int, device) -> _Scratch:
    """The scratch buffers of ``rows``' forward pass for this model's shape (made by its first layer)."""
    key = (kv_heads, n, group, dim, padded)
    scratch = rows.buffers.get(key)
    if scratch is None:
        scratch = rows.buffers[key] = _Scratch(kv_heads, n, group, dim, padded, rows.start, device)
    return scratch


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: RowKeys, scale: float,
           kind: str | None = None) -> torch.Tensor:
    """Attention of the step's rows. ``q`` (1, H, n, D) after rotary embedding; ``keys``, ``values`` (1, Hkv, S, D)
    fp32, the layer's cache with the step's keys appended; ``H`` a multiple of ``Hkv`` (query head ``h`` reads
    key/value head ``h // (H / Hkv)``). ``kind``: how the products are computed (``KINDS``; default: the one
    ``batch_invariant`` found row-invariant here). Returns (1, n, H * D) in ``q``'s dtype; ``q`` may also be given as
    (n, H, D), as the lean forward holds it, and then (n, H * D) is returned.

    Every row's scores are laid out alike whatever rows go with it: ``start`` shared scores, then its window's
    ``BLOCK`` (masked ones -inf), one row of a (Hkv, rows, start + BLOCK) buffer; the softmax's maximum and sum are
    taken over that row, and the weighted values are the shared part's product plus the window's. Inference only
    (products are written into the scratch buffers with ``out=``, which autograd does not take)."""
    if q.dim() == 4:
        return attend(q[0].transpose(0, 1), keys, values, rows, scale, kind)[None]
    n, heads, dim = q.shape
    product, pad = KINDS[kind or batch_invariant(heads, keys.shape[1], dim) or "bmm-4"]
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    if rows.group != group:
        raise ValueError(f"rows laid out for {rows.group} query heads per kv head; this model has {group}")
    m = n * group
    padded = max(m, pad)  # the rows every product runs on (zero rows after the step's)
    # (Hkv, m, D): one kv head's queries, row-major by (row, query head); the scale applied first (exact for a power
    # of two, and the same elementwise product for every row either way)
    scratch = scratch_for(rows, kv_heads, n, group, dim, padded, q.device)
    q32 = q if q.dtype == torch.float32 else q.float()
    torch.mul(q32.view(n, kv_heads, group, dim).transpose(0, 1), scale, out=scratch.step_queries)
    lib = native.library() if keys.device.type == "cpu" else None
    out = attend_scaled(scratch, keys[0], values[0], rows, n, product, lib)
    return out if q.dtype == torch.float32 else out.to(q.dtype)


def attend_scaled(scratch: _Scratch, k: torch.Tensor, v: torch.Tensor, rows: RowKeys, n: int, product,
                  lib=None, tiles: bool = False) -> torch.Tensor:
    """``attend`` from the step's queries already scaled in ``scratch.queries``: ``k``, ``v`` (Hkv, S, D) fp32.
    Returns (n, H * D) fp32. With ``lib`` (``native.library()``) it is one native call (``tr_attend``: each row and
    head computed alone, in the same order as here, its products as fixed sequences of multiply-adds instead of
    ``product``'s; ~30 torch operations a layer less), or with ``tiles`` ``tr_attend_amx`` (the amx format's: the
    shared part on AMX tiles, ``native.attention_on_tiles``); else torch operations."""
    if lib is not None:
        return _native((native.attention_on_tiles() if tiles else None) or lib.tr_attend, scratch, k, v, rows, n)
    kv_heads, _, dim = k.shape
    start, group = rows.start, rows.group
    m = n * group
    size = k.shape[1]
    if size < BLOCK:  # at least a window's keys (zero keys added, their scores dropped): one code path for any count
        k = torch.cat([k, k.new_zeros(kv_heads, BLOCK - size, dim)], 1)
    scores = product(scratch.queries, k.transpose(1, 2))  # (Hkv, padded, max(S, BLOCK))
    scores = scores[:, :m]
    index, hidden = rows.grouped  # (m, BLOCK)
    step, own = scratch.step, scratch.own
    if start:
        scratch.shared.copy_(scores[:, :, :start])
    torch.gather(scores, 2, index.expand(kv_heads, -1, -1), out=own)
    own.masked_fill_(hidden, float("-inf"))
    top = step.amax(-1, keepdim=True)
    step.sub_(top).exp_()
    total = step.sum(-1, keepdim=True)
    window = v.index_select(1, rows.flat).view(kv_heads * n, BLOCK, dim)
    # the window's weights copied out (rows of BLOCK, however many rows the step has), then by the window's values
    out = torch.bmm(own.contiguous().view(kv_heads * n, group, BLOCK), window).view(kv_heads, m, dim)
    if start:
        out = product(scratch.padded_shared, v[:, :start])[:, :m] + out
    out = out.div_(total)  # (Hkv, m, D)
    return out.view(kv_heads, n, group, dim).transpose(0, 1).reshape(n, kv_heads * group * dim)


def _native(call, scratch: _Scratch, k: torch.Tensor, v: torch.Tensor, rows: RowKeys, n: int) -> torch.Tensor:
    kv_heads, _, dim = k.shape
    padded = scratch.queries.shape[1]
    if k.stride()[1:] != (dim, 1) or v.stride() != k.stride():  # rows of D floats, the same per head in both
        k, v = k.contiguous(), v.contiguous()
    # what the C reads without checking: fp32 buffers of these layouts, and every key the rows' windows name
    if not (k.dtype == v.dtype == torch.float32 and k.shape == v.shape and k.shape[1] >= rows.keys
            and rows.index.dtype == torch.int64 and rows.valid.dtype == torch.bool):
        raise ValueError(f"native attention: fp32 keys and values of rows of {dim} holding {rows.keys} keys "
                         f"expected, got {k.dtype} {tuple(k.shape)} {k.stride()} and {v.dtype} {tuple(v.shape)} "
                         f"{v.stride()}")
    out = torch.empty(n, kv_heads * rows.group * dim, dtype=torch.float32)
    call(scratch.queries.data_ptr(), padded, k.data_ptr(), v.data_ptr(), k.stride(0), rows.start,
         rows.index.data_ptr(), rows.valid.data_ptr(), n, rows.group, kv_heads, dim, out.data_ptr(),
         torch.get_num_threads())
    return out


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, rows: RowKeys, scale: float) -> torch.Tensor:
    """The same attention by torch's SDPA over an explicit mask (to check ``attend`` against, to float tolerance)."""
    _, heads, n, dim = q.shape
    size = keys.shape[2]
    allowed = torch.zeros(n, size, dtype=torch.bool, device=q.device)
    allowed[:, :rows.start] = True
    which = rows.valid.nonzero(as_tuple=True)
    allowed[which[0], rows.index[which]] = True
    out = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=allowed[None, None],
                                         scale=scale, enable_gqa=heads != keys.shape[1])
    return out.transpose(1, 2).reshape(1, n, heads * dim).to(q.dtype)


def batch_invariant(heads: int, kv_heads: int, head_dim: int) -> str | None:
    """The first of ``KINDS`` with which ``attend`` gives every row the same bits alone and among others on this
    machine and torch build, for a model of this many query and key/value heads and head size (``_rows_agree``);
    None where none does. Checked once per process and shape for what runs the softmax (``native.tag``)."""
    return _batch_invariant(heads, kv_heads, head_dim, native.tag())


@functools.cache
def _batch_invariant(heads: int, kv_heads: int, head_dim: int, _softmax: str) -> str | None:
    for kind in KINDS:
        try:
            if _rows_agree(kind, heads, kv_heads, head_dim):
                return kind
        except (RuntimeError, AttributeError, NotImplementedError):  # a kernel missing from this build
            continue
    return None


def _rows_agree(kind: str, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Random steps, causal chains of up to 64 rows and draft trees of 81 nodes (depth up to 6), on 0 to 1,300 cached
    keys (fewer and more than a window's keys among them): each row against itself computed alone, on a cache holding
    exactly the keys it sees before it, as plain decoding computes it."""
    g = torch.Generator().manual_seed(0)
    group = heads // kv_heads
    for past, tree in ((0, False), (10, False), (100, True), (128, False), (192, True), (700, False), (1300, True)):
        parents = _random_tree(81, min(6, window_room(past)), g) if tree else None
        n = len(parents) if tree else window_room(past) + 1
        paths = _paths(parents) if tree else [list(range(i + 1)) for i in range(n)]
        keys = torch.randn(1, kv_heads, past + n, head_dim, generator=g)
        values = torch.randn(1, kv_heads, past + n, head_dim, generator=g)
        q = torch.randn(1, heads, n, head_dim, generator=g)
        visible = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(paths):
            visible[i, p] = True
        depth = torch.tensor([len(p) - 1 for p in paths])
        together = attend(q, keys, values, row_keys(past, past + depth, visible, group), 0.125, kind)
        for i, p in enumerate(paths):
            seen = torch.cat([torch.arange(past), past + torch.tensor(p)])
            position = past + len(p) - 1
            alone = attend(q[:, :, i:i + 1], keys[:, :, seen], values[:, :, seen],
                           row_keys(position, torch.tensor([position]), None, group), 0.125, kind)
            if not torch.equal(alone, together[:, i:i + 1]):
                return False
    return True


def _random_tree(size: int, depth: int, g: torch.Generator) -> list[int]:
    """Parents of a random tree of ``size`` nodes in BFS order, ``depth`` levels below the root (at least one node
    each; none when ``depth`` is 0)."""
    if depth == 0:
        return [-1]
    cuts = sorted(torch.randperm(size - 2, generator=g)[:depth - 1].add(1).tolist()) if depth > 1 else []
    widths = [b - a for a, b in zip([0] + cuts, cuts + [size - 1])]
    parents, level = [-1], [0]
    for width in widths:
        start = len(parents)
        parents += [level[int(torch.randint(len(level), (1,), generator=g))] for _ in range(width)]
        level = list(range(start, len(parents)))
    return parents


def _paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from the root, root first: ``[-1, 0, 0, 1] -> [[0], [0, 1], [0, 2], [0, 1, 3]]``."""
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        paths.append([i] if parent < 0 else paths[parent] + [i])
    return paths

"""A lean forward for Llama-family decoder models: the same operations as transformers' ``LlamaModel`` in the same
order, without its per-call machinery.

A decoding step of a small model on a CPU is not all matmul. For the embedded model (30 layers, fp16 weights, one
token) the linear layers took ~14 ms of a ~38 ms step; much of the rest was Python: ~15 module calls per layer, each
through ``nn.Module.__call__``, the keyword-argument decorators of every attention and decoder layer, the output
capturing of the model, mask preparation. ``LeanLlama`` runs the layers' own weights and kernels (a linear's
``forward``, or a ``ChosenLinear``'s kernel called directly on 2D activations, so the linears' kernels chosen by
``chooser.prepare_model`` are used as they are) with the same tensor operations, the rotary embedding's rewritten bit
for bit in fewer (``_rope``), but one: for fp32 and bf16 models, attention is ``attention.attend`` (fp32, each row
computed alike whatever rows go with it) instead of torch's SDPA, so hidden states equal the model's to float
tolerance and a token's are bit for bit the same in a plain step, a tree and a prefill. Other dtypes (the float64
test models) keep SDPA and equal the model's bit for bit (tested against ``generate``).

With fp32 activations (fp32 weights, or fp16 weights computed in fp32) and the C library built for the machine
(``native.py``), a windowed pass runs ``_windowed_native``: the operations between the linear layers are a few
``native.c`` calls a layer instead of ~90 torch operations (RMS norms with the residual adds, the rotary embedding
with the cache write, attention's softmax and window, SiLU times up), each row computed alone as well.

It takes the model only where its decoder layers are transformers' own Llama ones (``supports``); any other model
runs its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from . import attention, kv, layouts, native
from .fusion import FUSED, fuse, fused_shapes, layers_swapped, stackable, supports, swaps  # noqa: F401 (offered here)


@dataclass
class LeanOutput:
    last_hidden_state: torch.Tensor


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # LlamaRMSNorm.forward, operation for operation (the conversions only where they convert)
    dtype = hidden.dtype
    if dtype != torch.float32:
        hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * (hidden if dtype == torch.float32 else hidden.to(dtype))


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, bit for bit, in four operations: ``rotate_half(x)`` is
    ``x`` rolled by half its size with the first half negated, and the sign is carried by ``signed_sin`` (``sin``
    with its first half negated: ``-a * b == a * -b`` exactly)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def _signed(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _linear(module: nn.Module):
    """The call of a linear layer of the lean forward, which gives it 2D contiguous activations: a ``ChosenLinear``'s
    ``rows`` (its kernel without the reshapes), else the module's forward."""
    return getattr(module, "rows", module.forward)


# tr_layers' code of each of native.c's linear layers (``layouts.WeightTiles.kernel`` -> its ``f16`` argument)
KERNEL_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, "amx": 3}


def _split(call, sizes: tuple[int, ...]):
    """A fused layer's call returning its parts (views of one output, columns in order)."""
    def parts(x: torch.Tensor):
        return call(x).split(sizes, dim=-1)
    return parts


def _together(*calls):
    """Separate layers' calls, as one call returning their outputs."""
    def parts(x: torch.Tensor):
        return tuple(call(x) for call in calls)
    return parts


def _projections(owner: nn.Module, fused_name: str, names: tuple[str, ...]):
    if hasattr(owner, fused_name):
        return _split(_linear(getattr(owner, fused_name)), tuple(getattr(owner, n).out_features for n in names))
    return _together(*(_linear(getattr(owner, n)) for n in names))


def _joined(owner: nn.Module, fused_name: str, names: tuple[str, ...]):
    """A call returning the projections side by side in one (rows, sum of outputs) tensor: the fused layer's own, or
    the separate layers' outputs concatenated."""
    if hasattr(owner, fused_name):
        return _linear(getattr(owner, fused_name))
    calls = tuple(_linear(getattr(owner, n)) for n in names)

    def joined(x: torch.Tensor):
        return torch.cat([call(x) for call in calls], dim=-1)
    return joined


def _layer_calls(layer: nn.Module) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    (_, qkv_name, qkv_names), (_, gate_up_name, gate_up_names) = FUSED
    return (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
            _projections(attn, qkv_name, qkv_names), _linear(attn.o_proj),
            layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
            _projections(mlp, gate_up_name, gate_up_names), _linear(mlp.down_proj), mlp.act_fn,
            _joined(attn, qkv_name, qkv_names), _joined(mlp, gate_up_name, gate_up_names))


def _norm_pointers(calls: tuple) -> tuple[int, ...]:
    """Where the norms' weights of ``LeanLlama._layers``' calls lie in memory now."""
    return tuple(t.data_ptr() for row in calls for t in (row[0], row[4]))


def _rows(out: torch.Tensor) -> None:
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"the native forward takes contiguous fp32 linear outputs, not {out.dtype} "
                         f"{tuple(out.shape)} {out.stride()}")


class LeanLlama:
    """Callable like the base model in decoding (``input_ids``, ``position_ids``, ``attention_mask`` (a 4D additive
    mask, or None for causal), ``cache``) and returning an object with ``last_hidden_state``. A tree step may give
    ``visible`` instead of the mask ((n, n) bool: which of the step's rows each row sees, every cached position seen):
    the windowed attention reads only that, and a 4D mask over the whole cache is not made each step."""

    def __init__(self, model: nn.Module):
        base = model.base_model
        config = model.config
        self.base = base
        self.embed = base.embed_tokens
        self.rotary = base.rotary_emb
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        first = base.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.gqa = self.heads != self.kv_heads
        self.silu = getattr(config, "hidden_act", None) == "silu"
        # (swaps, id of the layer list, the list, per layer its calls, per row count its tr_layers program): ``_layers``
        self._collected = None
        self._one_row_rotary: dict = {}  # ``_rotary``'s: (block, dtype, device, inv_freq's memory) -> rows' (cos, sin)

    @property
    def window(self) -> int | None:
        """``attention.BLOCK`` where rows are computed alike alone and among others (``attention.py``: fp32 and bf16
        models, where this machine's kernels allow it): then a forward pass's rows must lie in one window of that
        many positions, and the cache holds fp32. None for other dtypes (float64 tests keep torch's SDPA)."""
        if (self.embed.weight.dtype in (torch.float32, torch.bfloat16)
                and attention.batch_invariant(self.heads, self.kv_heads, self.head_dim)):
            return attention.BLOCK
        return None

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary module's ``(cos, sin)`` for ``position_ids``. A one-row pass (a plain step) reads its row from
        the module's output for the ``attention.BLOCK`` positions around it, made once per block and kept: the
        module computes each position alone (one product, then cos and sin, per element), so the row is the one it
        gives for the position alone (test_lean.py checks it bit for bit), without its ~10 operations a step. For the
        default rotary type only (the others may change their frequencies as they go)."""
        if (position_ids.numel() != 1 or torch.is_grad_enabled()
                or getattr(self.rotary, "rope_type", None) != "default"):
            return self.rotary(hidden, position_ids)
        position = int(position_ids)
        block, offset = divmod(position, attention.BLOCK)
        key = (block, hidden.dtype, hidden.device, self.rotary.inv_freq.data_ptr())
        rows = self._one_row_rotary.get(key)
        if rows is None:
            if len(self._one_row_rotary) >= 1024:  # 64k positions' worth; then made afresh
                self._one_row_rotary.clear()
            first = block * attention.BLOCK
            ids = torch.arange(first, first + attention.BLOCK, device=position_ids.device)[None]
            cos, sin = self.rotary(hidden, ids)
            rows = self._one_row_rotary[key] = [(cos[:, i:i + 1], sin[:, i:i + 1]) for i in range(attention.BLOCK)]
        return rows[offset]

    def _layers(self) -> tuple:
        """Per layer, what a step calls: norms' weights and epsilons, the linears' calls, the activation. Collected
        once (~1 ms a step through ``nn.Module`` attribute lookups otherwise) and again after ``kernels.apply_plan``
        swapped the linears (``layers_swapped``) or the layer list was replaced."""
        layers = self.base.layers
        if self._collected is None or self._collected[:2] != (swaps(), id(layers)):
            self._collected = (swaps(), id(layers), layers, tuple(_layer_calls(layer) for layer in layers), {})
        return self._collected[3]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, cache=None, use_cache: bool = True,
                 visible: torch.Tensor | None = None, **_) -> LeanOutput:
        if cache is None:
            raise ValueError("LeanLlama needs a cache")
        batch, n = input_ids.shape
        past = cache.get_seq_length()
        hidden = self.embed(input_ids)
        if position_ids is None:
            position_ids = (torch.arange(n, device=hidden.device) + past)[None]
        rows = None
        if batch == 1 and self.window is not None:
            if attention_mask is not None:
                visible = attention_mask[0, 0, :, past:]
                visible = visible if visible.dtype == torch.bool else visible == 0
            rows = attention.row_keys(past, position_ids[0], visible, self.heads // self.kv_heads)
        elif visible is not None and attention_mask is None:  # as a mask over the cache and the step's rows
            attention_mask = torch.cat([visible.new_ones(n, past), visible], 1)[None, None]
        cos, sin = self._rotary(hidden, position_ids)
        if rows is not None:
            lib = self._native(hidden)
            if lib is not None:
                return LeanOutput(self._windowed_native(lib, hidden[0], cos[0], sin[0], rows, cache)[None])
            sin = _signed(sin)
            return LeanOutput(self._windowed(hidden[0], cos[0, :, None], sin[0, :, None], rows, cache.layers)[None])
        sin = _signed(sin)
        is_causal = False
        mask = attention_mask
        if mask is None and n > 1:
            if past == 0:
                is_causal = True  # a prefill: SDPA's own causal pattern, as transformers uses it
            else:  # several tokens in a chain on top of the cache: each sees the cache and the tokens up to itself
                q = torch.arange(past, past + n, device=hidden.device)[:, None]
                mask = (torch.arange(past + n, device=hidden.device)[None, :] <= q)[None, None]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        shape = (batch, n, -1, self.head_dim)
        sdpa_kwargs = {"enable_gqa": True} if self.gqa else {}
        layers = cache.layers
        for i, (w1, eps1, qkv, o_proj, w2, eps2, gate_up, down, act, *_) in enumerate(self._layers()):
            residual = hidden
            x = _rms_norm(hidden, w1, eps1).reshape(batch * n, -1)
            q, k, v = qkv(x)
            q = _rope(q.reshape(shape).transpose(1, 2), cos, sin)
            k = _rope(k.reshape(shape).transpose(1, 2), cos, sin)
            v = v.reshape(shape).transpose(1, 2)
            k, v = layers[i].update(k, v)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=self.scaling,
                                                 is_causal=is_causal, **sdpa_kwargs)
            out = out.reshape(out.shape[0], -1, n, v.shape[-1]).transpose(1, 2).contiguous()
            hidden = residual + o_proj(out.reshape(batch * n, -1)).view(batch, n, -1)
            residual = hidden
            x = _rms_norm(hidden, w2, eps2).reshape(batch * n, -1)
            g, u = gate_up(x)
            hidden = residual + down(act(g) * u).view(batch, n, -1)
        norm = self.base.norm
        return LeanOutput(_rms_norm(hidden, norm.weight, norm.variance_epsilon))

    def small_ops(self) -> str:
        """What computes the layers' small operations (all but the linear layers and attention's two products):
        ``native.c``'s calls, or torch's operations, and why."""
        if self.window is None:
            return "torch's operations (no batch-invariant attention here)"
        if self.embed.weight.dtype != torch.float32 or not self.silu:
            return "torch's operations (the native calls take fp32 activations and SiLU)"
        if native.library() is None:
            return f"torch's operations (native calls {native.status()})"
        notes = "".join(f"; {note}" for note in (native.fetch_note(), native.sharing_note()) if note)
        tiles = ", attention over the keys before its window on AMX tiles" if self._on_tiles() else ""
        return f"native calls built for this CPU (one call per norm, rotary embedding, attention, SiLU{tiles}){notes}"

    def _native(self, hidden: torch.Tensor):
        """``native.library()`` where this pass can run on it (fp32 activations, SiLU)."""
        if hidden.dtype != torch.float32 or not self.silu:
            return None
        return native.library()

    def _windowed_native(self, lib, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         rows: attention.RowKeys, cache) -> torch.Tensor:
        """``_windowed`` with the small operations in ``native.c``'s calls (the same model, other float roundings):
        ``hidden`` (n, d) fp32, modified in place; ``cos``, ``sin`` (n, head_dim), ``sin`` as the model gives it.
        Where every linear layer of the pass is native.c's and the cache preallocated, the whole stack of layers is
        one call (``tr_layers``: the same calls in the same order, so the same bits, without ~300 Python calls)."""
        n, d = hidden.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        group = heads // kv_heads
        product, pad = attention.KINDS[attention.batch_invariant(heads, kv_heads, dim) or "bmm-4"]
        padded = max(n * group, pad)
        cos, sin = cos.contiguous(), sin.contiguous()
        layers = cache.layers
        program = self._program(n) if self.stacked else None
        if program is not None and all(hasattr(layer, "extend") for layer in layers):
            return self._stacked(program, hidden, cos, sin, padded, rows, cache)
        like = hidden.new_empty(1, kv_heads, n, dim)
        x = torch.empty_like(hidden)
        scratch = attention.scratch_for(rows, kv_heads, n, group, dim, padded, hidden.device)
        rope = (cos, sin, scratch.queries, padded)
        pointers = (hidden.data_ptr(), x.data_ptr())
        delta = None  # the last layer's output, added to the residual stream by the next norm
        act = None
        for i, (w1, eps1, _, o_proj, w2, eps2, _, down, _, qkv, gate_up) in enumerate(self._layers()):
            lib.tr_add_rms_norm(pointers[0], None if delta is None else delta.data_ptr(), w1.data_ptr(), eps1, n, d,
                                pointers[1])
            joined = qkv(x)
            if i == 0:  # what the C reads: fp32 rows (checked on the first layer: all run alike)
                _rows(joined)
            keys, values = self._rope_store(lib, layers[i], like, joined, rope)
            o = o_proj(attention.attend_scaled(scratch, keys, values, rows, n, product, lib, self._on_tiles()))
            if i == 0:
                _rows(o)
            lib.tr_add_rms_norm(pointers[0], o.data_ptr(), w2.data_ptr(), eps2, n, d, pointers[1])
            both = gate_up(x)
            if i == 0:
                _rows(both)
                act = both.new_empty(n, both.shape[1] // 2)
            lib.tr_silu_mul(both.data_ptr(), n, act.shape[1], act.data_ptr())
            # kept as a tensor until read (a freed buffer's first bytes are the allocator's)
            delta = down(act)
            if i == 0:
                _rows(delta)
        norm = self.base.norm
        lib.tr_add_rms_norm(pointers[0], delta.data_ptr(), norm.weight.data_ptr(), norm.variance_epsilon, n, d,
                            pointers[1])
        return x

    stacked = True  # whether a pass may run as one tr_layers call (off: the same calls from Python, for tests)

    def _on_tiles(self) -> bool:
        """Whether attention runs on AMX tiles (``native.attention_on_tiles``): in the amx format, as ``tr_layers``
        does for it, so a pass made call by call has the same bits as one made in one call."""
        qkv = getattr(self.base.layers[0].self_attn, FUSED[0][1], None) if len(self.base.layers) else None
        return (getattr(qkv, "fmt", None) == "amx" and self.head_dim == 64  # native.c's attend_amx takes heads of 64
                and native.attention_on_tiles() is not None)

    def _program(self, n: int):
        """For passes of ``n`` rows: (per layer the pointers tr_layers reads, as an int64 tensor (layers, 6); the
        norms' epsilons (layers, 2) fp32; whether the weights are fp16; the intermediate size; the tensors pointed to;
        where the norms' weights lay), where every linear layer runs native.c's kernel for ``n`` rows (the tiles of
        one dtype) and ``tr_layers`` is built here; else None. Made once per row count, and again after the linears
        were swapped or a norm's weight moved."""
        calls = self._layers()
        programs = self._collected[4]
        program = programs.get(n, False)
        if program is False or (program is not None and program[5] != _norm_pointers(calls)):
            # first use, or a norm's weight was given new memory (``param.data = ...``, as ``chooser.own_weights``
            # does) since the pointers were taken
            program = programs[n] = self._make_program(n, calls)
        return program

    def _make_program(self, n: int, calls) -> tuple | None:
        if native.stacked() is None or not self.silu:
            return None
        pointers, eps, dtypes, inter, all_tiles = [], [], set(), None, []
        for layer, (w1, eps1, _, _, w2, eps2, _, _, _, _, _) in zip(self.base.layers, calls):
            attn, mlp = layer.self_attn, layer.mlp
            linears = [getattr(attn, FUSED[0][1], None), attn.o_proj, getattr(mlp, FUSED[1][1], None), mlp.down_proj]
            tiles = []
            for lin in linears:
                kernel_for = getattr(lin, "kernel_for", None)
                packed = layouts.native_tiles(*kernel_for(n)) if kernel_for is not None else None
                if packed is None or getattr(lin, "bias", None) is not None:
                    return None
                tiles.append(packed)
            dtypes.update(t.kernel for t in tiles)
            all_tiles += tiles
            inter = tiles[3].in_features
            if not (w1.dtype == w2.dtype == torch.float32 and w1.is_contiguous() and w2.is_contiguous()):
                return None
            pointers.append([w1.data_ptr(), tiles[0].tiles.data_ptr(), tiles[1].tiles.data_ptr(), w2.data_ptr(),
                             tiles[2].tiles.data_ptr(), tiles[3].tiles.data_ptr()])
            eps.append([eps1, eps2])
        if len(dtypes) != 1 or dtypes - set(KERNEL_CODES):
            return None
        # the tiles and norms' memory is also held here (the layers may let go of it); the program is made anew after
        # the linears were swapped (``_layers``) or a norm's memory changed (``_program``)
        held = [t.detach() for row in calls for t in (row[0], row[4])] + [t.tiles for t in all_tiles]
        return (torch.tensor(pointers, dtype=torch.int64), torch.tensor(eps, dtype=torch.float32),
                KERNEL_CODES[dtypes.pop()], inter, held,
                _norm_pointers(calls))

    def _stacked(self, program, hidden, cos, sin, padded, rows, cache) -> torch.Tensor:
        """The pass as one ``tr_layers`` call: its work buffers (the queries (Hkv, padded, D), then q/k/v, attention's
        output, o, gate/up, the activation and the last layer's output, each (n, ...)) are one fp32 tensor, given to
        the call as addresses within it; the cache is extended in all layers at once where they share its store
        (``kv.extend_on_store``), else layer by layer."""
        weights, eps, f16, inter = program[:4]
        n, d = hidden.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        store = getattr(cache, "kv_store", None)
        found = None
        if store is not None and store.dtype == torch.float32 and store.shape[1::2] == (kv_heads, dim):
            found = kv.extend_on_store(cache, n)
        if found is not None:
            past, pointers = found
        else:
            like = hidden.new_empty(1, kv_heads, n, dim)
            held, past = [], None
            for layer in cache.layers:
                key_buf, value_buf, start = layer.extend(like)
                if not (key_buf.dtype == value_buf.dtype == torch.float32 and key_buf.is_contiguous()
                        and value_buf.is_contiguous() and key_buf.shape == value_buf.shape):
                    raise ValueError(f"the native forward writes an fp32 cache; this layer holds {key_buf.dtype}")
                if past is not None and start != past:
                    raise ValueError(f"the cache's layers hold {past} and {start} positions")
                past = start
                held.append((key_buf.data_ptr(), value_buf.data_ptr(), key_buf.stride(1)))
            pointers = torch.tensor(held, dtype=torch.int64)  # held until the call returns
        if rows.keys != past + n:
            raise ValueError(f"rows laid out for {rows.keys} keys; the cache holds {past + n}")
        tiles = (None, 0, 0)  # the amx format's attention lays the tiles of the keys afresh in each layer's call,
        # or keeps them with a cache on one store (taken just before the call: once taken, they count as laid)
        if found is not None and f16 == KERNEL_CODES["amx"] and self._on_tiles():
            tiles = kv.tiles_for(cache, rows.start)
        sizes = (kv_heads * padded * dim, n * (heads + 2 * kv_heads) * dim, n * heads * dim, n * d, n * 2 * inter,
                 n * inter, n * d)
        work = hidden.new_empty(sum(sizes) + n * d)
        at, base = [], work.data_ptr()
        for size in sizes:
            at.append(base)
            base += 4 * size
        queries, qkv, att, o, gate_up, act, delta = at
        x = work[-n * d:].view(n, d)  # the final norm's output: what the pass returns
        norm = self.base.norm
        native.stacked()(
            len(cache.layers), weights.data_ptr(), eps.data_ptr(), pointers.data_ptr(), past, int(f16), d, heads,
            kv_heads, dim, inter, self.scaling, n, hidden.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(),
            queries, padded, rows.start, rows.index.data_ptr(), rows.valid.data_ptr(), qkv, att, o, gate_up, act,
            delta, norm.weight.data_ptr(), norm.variance_epsilon, torch.get_num_threads(),
            None if tiles[0] is None else tiles[0].data_ptr(), tiles[1], tiles[2])
        return x

    def _rope_store(self, lib, layer, like: torch.Tensor, joined: torch.Tensor,
                    rope: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's queries rotated into the scratch buffer, its keys rotated and its values into the layer's
        cache, from ``joined`` (n, (H + 2 Hkv) D): each row's q, k and v side by side; returns the layer's keys and
        values (Hkv, positions, head_dim) fp32. A preallocated layer (``kv.PreallocatedLayer.extend``) is written in
        place; another one takes the rows through its ``update``."""
        cos, sin, queries, padded = rope
        n, kv_heads, dim = like.shape[2], like.shape[1], like.shape[3]
        preallocated = hasattr(layer, "extend")
        if preallocated:
            key_buf, value_buf, past = layer.extend(like)
            if not (key_buf.dtype == value_buf.dtype == torch.float32 and key_buf.is_contiguous()
                    and value_buf.is_contiguous() and key_buf.shape == value_buf.shape):
                raise ValueError(f"the native forward writes an fp32 cache; this layer holds {key_buf.dtype}")
            key_at, value_at, stride = key_buf, value_buf, key_buf.stride(1)
        else:
            key_at, value_at, stride, past = torch.empty_like(like), torch.empty_like(like), n * dim, 0
        q = joined.data_ptr()
        k = q + 4 * self.heads * dim
        lib.tr_rope_store(q, k, k + 4 * kv_heads * dim, joined.stride(0), cos.data_ptr(), sin.data_ptr(), n,
                          self.heads, kv_heads, dim, self.scaling, queries.data_ptr(), padded, key_at.data_ptr(),
                          value_at.data_ptr(), stride, past)
        if preallocated:
            return key_buf[0, :, :past + n], value_buf[0, :, :past + n]
        keys, values = layer.update(key_at, value_at)
        return keys[0], values[0]

    def _windowed(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: attention.RowKeys,
                  layers) -> torch.Tensor:
        """The layers for one sequence on the batch-invariant attention, on 2D activations: ``hidden`` (n, d), the
        embedded tokens; ``cos``, ``sin`` (n, 1, head_dim), ``sin`` signed (``_signed``). Returns the final hidden
        states (n, d)."""
        n = hidden.shape[0]
        heads, kv_heads = (n, self.heads, self.head_dim), (n, self.kv_heads, self.head_dim)
        for i, (w1, eps1, qkv, o_proj, w2, eps2, gate_up, down, act, *_) in enumerate(self._layers()):
            x = _rms_norm(hidden, w1, eps1)
            q, k, v = qkv(x)
            q = _rope(q.reshape(heads), cos, sin)
            k = _rope(k.reshape(kv_heads), cos, sin)
            v = v.reshape(kv_heads)
            # the cache holds fp32 (1, Hkv, positions, head_dim)
            if k.dtype != torch.float32:
                k, v = k.float(), v.float()
            keys, values = layers[i].update(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            hidden = hidden + o_proj(attention.attend(q, keys, values, rows, self.scaling))
            x = _rms_norm(hidden, w2, eps2)
            g, u = gate_up(x)
            hidden = hidden + down(act(g) * u)
        norm = self.base.norm
        return _rms_norm(hidden, norm.weight, norm.variance_epsilon)

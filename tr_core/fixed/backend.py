"""The torch backend: every forward pass of a run at one shape, on any torch device, identical by construction.

A run (``FixedRun``) computes each pass over ``rows`` query rows (the draft's nodes, then padding rows that nothing
reads) and ``slots`` key slots (``rows.py``): plain decoding and every method then run the same kernels on the same
shapes, and each row reads the keys plain decoding would read, in its order. A row's numbers so depend on its own
inputs only, and every method's tokens equal plain decoding's on this backend, on a CPU or a GPU alike. The prefill
goes in passes of at most ``rows`` prompt tokens (a chain) that end at attention windows' ends, the same passes
again.

The model runs its own transformers forward, with ``rows.fixed_rows_attention`` as its attention implementation
(registered with transformers; where no run's buffers are given, it falls back to SDPA, so the model still works as
before elsewhere). On CUDA a pass is captured once per run as a CUDA graph (``graph.py``) and replayed each step:
the inputs are copied into static tensors, the slots are computed on the device, one replay.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import PreTrainedModel

from ..tree import TreeBuffers
from . import graph, rows

TILE = 8  # a run's rows are a multiple of this
DEFAULT_ROWS = {"cuda": 128, "cpu": 16}  # rows a pass where the caller does not say: the paper's 80-node tree and
#                                          more on a GPU; on a CPU, where a pass's cost grows with its rows, fewer
SLOT_TILE = 64  # key slots are a multiple of this
WIDE_PREFILL = 64  # the tokens a pass a one-row run reads its prompt in


def round_up(n: int, tile: int) -> int:
    """``n`` rounded up to a multiple of ``tile``.

    >>> round_up(81, 8), round_up(8, 8)
    (88, 8)
    """
    return -(-n // tile) * tile


def default_rows(device: torch.device) -> int:
    return DEFAULT_ROWS.get(device.type, DEFAULT_ROWS["cuda"])


class OutputLayer:
    """A model's output layer as the torch backend computes it (``FixedRun.head``): hidden states (n, d) -> logits
    (n, V), for the rows given only."""

    def __init__(self, model: PreTrainedModel):
        head = model.get_output_embeddings()
        self.weight, self.bias = head.weight, getattr(head, "bias", None)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(hidden, self.weight, self.bias)


def project(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The output layer's logits (n, V) of ``hidden`` (n, d)."""
    logits = F.linear(hidden, weight)
    return logits + bias if bias is not None else logits


def _shape(model: PreTrainedModel) -> tuple[int, int, int]:
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return text.num_hidden_layers, kv_heads, head_dim


def supports(model: PreTrainedModel) -> str | None:
    """Why the torch backend cannot run ``model`` (None: it can): its attention layers must take transformers'
    attention interface (a ``layer_idx`` each) over full attention."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "it has sliding-window attention layers"
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]
    if len(layers) != text.num_hidden_layers:
        return (f"its attention modules do not take transformers' attention interface ({type(model).__name__}); "
                "the native backend runs it on a CPU")
    return None


class FixedRun:
    """One decoding on the torch backend: static buffers for ``rows`` query rows and ``slots`` cached positions."""

    resident = True  # its tensors live on the device: the decoding loop reads back once a step (decoding.py)

    def __init__(self, model: PreTrainedModel, head_weight: torch.Tensor, head_bias: torch.Tensor | None,
                 rows_: int, slots: int, capture: bool):
        self.model, self.device = model, model.device
        self.weight, self.bias = head_weight, head_bias
        self.max_nodes, self.slots = rows_, slots
        layers, kv_heads, head_dim = _shape(model)
        self.state = rows.RowsState(layers, kv_heads, head_dim, slots, rows_, model.dtype, self.device)
        self.ids = torch.zeros(rows_, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(rows_, dtype=torch.long, device=self.device)
        self.visible = torch.eye(rows_, dtype=torch.bool, device=self.device)
        self.past = torch.zeros((), dtype=torch.long, device=self.device)
        self._eye = torch.eye(rows_, dtype=torch.bool, device=self.device)
        self._capture = capture
        self._captured: graph.CapturedPass | None = None
        self.passes = 0
        self.logits: torch.Tensor | None = None  # the latest verified pass's logits, all its rows (rows, V)

    def _pass(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed-shape pass over the static inputs: hidden states (rows, d) and logits (rows, V)."""
        self.state.set_slots(self.past, self.visible)
        hidden = self.model.base_model(input_ids=self.ids[None], position_ids=self.positions[None], use_cache=False,
                                       tr_rows=self.state).last_hidden_state[0]
        return hidden, self.head(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(hidden, self.weight, self.bias)

    def _run(self, tokens: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
             past: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = tokens.numel()
        if n > self.max_nodes:
            raise ValueError(f"a pass of {n} rows on a run of {self.max_nodes}")
        if past + n > self.slots:
            raise ValueError(f"{past + n} positions on a run of {self.slots} slots")
        self.ids.zero_()
        self.ids[:n] = tokens
        self.positions.fill_(past)  # padding rows: a valid position, read by nothing
        self.positions[:n] = positions
        self.visible.copy_(self._eye)
        self.visible[:n, :n] = visible
        self.past.fill_(past)
        self.passes += 1
        if not self._capture:
            return self._pass()
        if self._captured is None:
            self._captured = graph.CapturedPass(self._pass, self.device)
        return self._captured.replay()

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """The prompt in chains of at most ``rows`` tokens that never cross an attention window's end. A one-row run
        (plain decoding unpadded, a speed baseline) reads it ``WIDE_PREFILL`` tokens a pass on a run of its own, whose
        cache it then copies: one token a pass would bill the baseline for hundreds of passes."""
        if self.max_nodes == 1 and ids.numel() > 1:
            wide = FixedRun(self.model, self.weight, self.bias, WIDE_PREFILL, self.slots, self._capture)
            hidden = wide.prefill(ids)
            self.state.kv[:, :, :, :self.slots] = wide.state.kv[:, :, :, :self.slots]
            return hidden
        out, past = [], 0
        while past < ids.numel():
            n = min(self.max_nodes, rows.window_room(past) + 1, ids.numel() - past)
            chunk = ids[past:past + n]
            chain = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            hidden, _ = self._run(chunk, torch.arange(past, past + n, device=self.device), chain, past)
            out.append(hidden[:n].clone())
            self.state.compact(past, torch.arange(n, device=self.device))
            past += n
        return torch.cat(out) if out else ids.new_zeros((0, self.weight.shape[1]), dtype=self.weight.dtype)

    def verify(self, tokens: torch.Tensor, tree: TreeBuffers, past_len: int) -> torch.Tensor:
        if tree.max_depth > rows.window_room(past_len):
            raise ValueError(f"a tree {tree.max_depth} deep on {past_len} cached positions crosses an attention "
                             f"window's end ({rows.window_room(past_len)} positions left in it)")
        positions = past_len + tree.depth.to(self.device)
        _, self.logits = self._run(tokens, positions, tree.mask.to(self.device), past_len)
        return self.logits[:tokens.numel()]

    def keep(self, past_len: int, tree_size: int, path: torch.Tensor) -> None:
        self.state.compact(past_len, path)

    def room(self, past_len: int) -> tuple[int, str] | None:
        # a pass's rows lie in one attention window (rows.py): the draft is cut at its end
        return rows.window_room(past_len), "at an attention window's end"


class TorchBackend:
    name = "torch"

    def __init__(self, model: PreTrainedModel, rows_: int | None = None, capture: bool | None = None):
        why = supports(model)
        if why:
            raise ValueError(f"the torch backend cannot run this model: {why}")
        self.model, self.device = model, model.device
        # one row stays one row: plain decoding unpadded, the speed baseline a padded run is compared with
        self.rows = 1 if rows_ == 1 else round_up(rows_ or default_rows(self.device), TILE)
        self.capture = graph.can_capture(self.device) if capture is None else capture
        rows.use_for(model)
        layer = OutputLayer(model)
        self.weight, self.bias = layer.weight, layer.bias

    def start(self, prompt_len: int, max_new_tokens: int) -> FixedRun:
        # the same slots for every method of one prompt and length: plain decoding's shapes are a tree's
        slots = round_up(prompt_len + max_new_tokens + self.rows + 1, SLOT_TILE)
        return FixedRun(self.model, self.weight, self.bias, self.rows, slots, self.capture)

    def describe(self) -> str:
        where = "the CPU" if self.device.type == "cpu" else str(self.device)
        graphs = ", one CUDA graph a step" if self.capture else ""
        return (f"torch backend on {where}: every pass {self.rows} rows at fixed shapes{graphs}, "
                f"{str(self.model.dtype).removeprefix('torch.')}")

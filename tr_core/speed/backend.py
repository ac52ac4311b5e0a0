"""The native backend (``tr_core.backend``'s seam): this project's CPU kernels behind the loop's four calls.

A run holds a preallocated KV cache (``kv.new_cache``); a pass is the lean forward (``lean.LeanLlama``) where the
model allows it, with the kernel plan chosen by measurement (``chooser.prepare_model``) and the batch-invariant
attention (``attention.py``), else the model's own forward with a 4D tree mask.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..tree import TreeBuffers
from .attention import window_room
from .kernels import OutputHead, body, cache_dtype, feed, grouped_query_attention_in_sdpa, kernel_summary, window
from .kv import keep_accepted_path, new_cache

SPARE = 128  # cache room past the output, for the largest tree a step may add before its path is kept


def tree_mask(tree: TreeBuffers, past_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive 4D mask (1, 1, n, past_len + n): 0 where a node may attend, the dtype's minimum elsewhere."""
    n = tree.size
    mask = torch.zeros(1, 1, n, past_len + n, dtype=dtype, device=device)
    mask[0, 0, :, past_len:].masked_fill_(~tree.mask.to(device), torch.finfo(dtype).min)
    return mask


def tree_attention(base: torch.nn.Module, tree: TreeBuffers, past_len: int, dtype: torch.dtype,
                   device: torch.device) -> dict:
    """The keyword that tells ``base`` (``body``'s forward) which positions each of a step's rows sees: none for a
    chain (causal); for the windowed attention of the lean forward, ``visible``, the tree's own (n, n) mask; else
    ``attention_mask``, the additive 4D mask over the cache and the tree (``tree_mask``; its size grows with the
    context: ~80 x 1,000 floats filled a step for the paper's tree at 900 cached tokens)."""
    if tree.size == tree.max_depth + 1:  # a chain
        return {}
    if window(base) is not None:
        return {"visible": tree.mask.to(device)}
    return {"attention_mask": tree_mask(tree, past_len, dtype, device)}


class NativeRun:
    max_nodes = None

    def __init__(self, model: PreTrainedModel, head: OutputHead, capacity: int):
        self.base, self.head, self.dtype, self.device = body(model), head, model.dtype, model.device
        self.cache = new_cache(model.config, capacity, cache_dtype(self.base, model.dtype), model.device)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        return feed(self.base, ids, self.cache)

    def verify(self, tokens: torch.Tensor, tree: TreeBuffers, past_len: int) -> torch.Tensor:
        positions = (past_len + tree.depth.to(self.device))[None]
        seen = tree_attention(self.base, tree, past_len, self.dtype, self.device)
        hidden = self.base(input_ids=tokens[None], position_ids=positions, cache=self.cache, use_cache=True,
                           **seen).last_hidden_state[0]
        return self.head(hidden)

    def keep(self, past_len: int, tree_size: int, path: torch.Tensor) -> None:
        keep_accepted_path(self.cache, past_len, tree_size, path)

    def room(self, past_len: int) -> tuple[int, str] | None:
        if window(self.base) is None:
            return None
        # the step's rows must lie in one attention window (attention.py): the draft is cut at its end
        return window_room(past_len), "at an attention window's end"


class NativeBackend:
    name = "native"

    def __init__(self, model: PreTrainedModel, head: OutputHead | None = None):
        if model.device.type != "cpu":
            raise ValueError(f"the native backend runs on the CPU; the model is on {model.device}")
        self.model, self.device = model, model.device
        self.head = head or OutputHead(model)
        grouped_query_attention_in_sdpa()  # tree steps attend to the cache without copying it (kernels.py)

    def start(self, prompt_len: int, max_new_tokens: int) -> NativeRun:
        # room for the whole output and a large tree, so that the cache never copies itself while decoding
        return NativeRun(self.model, self.head, prompt_len + max_new_tokens + SPARE)

    def describe(self) -> str:
        return f"native backend on the CPU: {kernel_summary(self.model)}"

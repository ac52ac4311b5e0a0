"""Which models the lean forward runs, and the fusion of their projections: q, k and v as one linear layer, gate
and up as another (``fuse``). Read by the layouts (which shapes a model's plan measures) and the lean forward alike,
so it sits below both.
"""

from __future__ import annotations

import torch
from torch import nn

from . import native


def supports(model: nn.Module) -> bool:
    """True where ``model`` is on the CPU and its body is transformers' ``LlamaModel`` with SDPA attention."""
    try:
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaModel, LlamaRMSNorm
    except ImportError:  # pragma: no cover
        return False
    base = getattr(model, "base_model", None)
    config = getattr(model, "config", None)
    if type(base) is not LlamaModel or config is None or base.embed_tokens.weight.device.type != "cpu":
        return False
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    layers = list(base.layers)
    return (len(layers) == config.num_hidden_layers
            and all(type(layer) is LlamaDecoderLayer for layer in layers)
            and all(type(n) is LlamaRMSNorm for layer in layers
                    for n in (layer.input_layernorm, layer.post_attention_layernorm))
            and type(base.norm) is LlamaRMSNorm)


class _Part(nn.Module):
    """One of the projections a fused linear layer computes together (``fuse``): the columns ``start:end`` of the
    output of the layer its ``owner`` holds as ``name`` (looked up at every call: ``kernels.apply_plan`` replaces
    it). Lets transformers' own forward run on a fused model, at the cost of computing the whole fused layer for each
    part (the decoding loop runs the lean forward, which calls the fused layer once)."""

    def __init__(self, owner: nn.Module, name: str, start: int, end: int):
        super().__init__()
        # the owner itself, not as a submodule (the owner holds this part); a deep copy of the model copies it with
        # the rest, so the copy's parts read the copy's fused layer
        object.__setattr__(self, "_owner", owner)
        self.name, self.start, self.end = name, start, end
        self.in_features, self.out_features = getattr(owner, name).in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self._owner, self.name)(x)[..., self.start:self.end].contiguous()

    def extra_repr(self) -> str:
        return f"{self.name}[{self.start}:{self.end}]"


FUSED = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def _is_fused(model: nn.Module) -> bool:
    return all(hasattr(layer.self_attn, FUSED[0][1]) for layer in model.base_model.layers)


def _fusable(model: nn.Module) -> bool:
    """Whether ``fuse`` applies: ``supports`` holds and every projection to fuse is a plain ``nn.Linear`` without
    bias, or the model is fused already."""
    if not supports(model):
        return False
    if _is_fused(model):
        return True
    layers = list(model.base_model.layers)
    return all(type(p) is nn.Linear and p.bias is None for layer in layers for block, _, names in FUSED
               for p in (getattr(getattr(layer, block), n) for n in names))


def stackable(model: nn.Module) -> bool:
    """Whether a pass of ``model`` can run as one ``tr_layers`` call where its linear layers run native.c's kernels:
    ``fuse`` applies, the activation is SiLU and ``tr_layers`` is built here."""
    return (_fusable(model) and getattr(model.config, "hidden_act", None) == "silu"
            and native.stacked() is not None)


def fused_shapes(model: nn.Module) -> set[str]:
    """The ``"<out>x<in>"`` shapes ``fuse`` would give ``model``'s fused layers (empty where it does not apply)."""
    if not _fusable(model):
        return set()
    layer = model.base_model.layers[0]
    out = set()
    for block, _, names in FUSED:
        parts = [getattr(getattr(layer, block), n) for n in names]
        out.add(f"{sum(p.out_features for p in parts)}x{parts[0].in_features}")
    return out


def fuse(model: nn.Module) -> bool:
    """Put each layer's q, k and v projections into one linear layer (``qkv_proj``), and its gate and up projections
    into another (``gate_up_proj``), in place; the old names become ``_Part``s of them. One call instead of three and
    two: a one-token step of the embedded model calls fbgemm's kernel 60 times less (~1.3 ms here). Only where
    ``supports`` holds and the layers are plain ``nn.Linear`` without bias; returns whether it fused (or had)."""
    if not _fusable(model):
        return False
    if _is_fused(model):
        return True
    for layer in model.base_model.layers:
        for block, fused_name, names in FUSED:
            owner = getattr(layer, block)
            parts = [getattr(owner, n) for n in names]
            weight = torch.cat([p.weight.detach() for p in parts])
            fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            fused.weight = nn.Parameter(weight, requires_grad=False)
            setattr(owner, fused_name, fused)
            start = 0
            for name, part in zip(names, parts):
                setattr(owner, name, _Part(owner, fused_name, start, start + part.out_features))
                start += part.out_features
    layers_swapped()
    return True


_SWAPS = [0]  # how many times linears were swapped (kernels.apply_plan): the layers' calls are collected anew


def layers_swapped() -> None:
    """Say that linear layers of some model were replaced: every ``LeanLlama`` collects its layers' calls anew."""
    _SWAPS[0] += 1


def swaps() -> int:
    """How many times linear layers were replaced in this process (``layers_swapped``)."""
    return _SWAPS[0]

"""Token Recycling (arXiv 2408.08696) over stock Hugging Face causal LMs, with plain greedy decoding and Prompt
Lookup Decoding as baselines. ``decode`` yields one plain-data ``StepEvent`` per forward pass.

Names are imported lazily, so that ``tr_core.events`` (plain dataclasses) can be read without importing torch.
"""

from importlib import import_module

_EXPORTS = {
    "DecodeResult": "decoding", "accept": "decoding", "decode": "decoding", "run": "decoding",
    "PlainDrafter": "drafters", "PromptLookupDrafter": "drafters", "RecyclingDrafter": "drafters",
    "RowUpdate": "events", "StepEvent": "events",
    "AdjacencyMatrix": "matrix",
    "EMBEDDED": "models", "ModelLoadError": "models", "encode_prompt": "models", "eos_token_ids": "models",
    "load_model": "models",
    "TokenText": "text",
    "BUILTIN_TEMPLATES": "tree", "TreeBuffers": "tree", "TreeTemplateError": "tree", "build_tree": "tree",
    "chain_tree": "tree", "load_template": "tree",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'tr_core' has no attribute {name!r}")

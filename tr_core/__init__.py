"""Token Recycling (arXiv 2408.08696) over stock Hugging Face causal LMs, with plain greedy decoding and Prompt
Lookup Decoding as baselines. ``decode`` yields one plain-data ``StepEvent`` per forward pass."""

from .decoding import DecodeResult, accept, decode, run
from .drafters import PlainDrafter, PromptLookupDrafter, RecyclingDrafter
from .events import RowUpdate, StepEvent
from .matrix import AdjacencyMatrix
from .models import EMBEDDED, ModelLoadError, encode_prompt, eos_token_ids, load_model
from .text import TokenText
from .tree import BUILTIN_TEMPLATES, TreeBuffers, TreeTemplateError, build_tree, chain_tree, load_template

__all__ = [
    "AdjacencyMatrix", "BUILTIN_TEMPLATES", "DecodeResult", "EMBEDDED", "ModelLoadError", "PlainDrafter",
    "PromptLookupDrafter", "RecyclingDrafter", "RowUpdate", "StepEvent", "TokenText", "TreeBuffers",
    "TreeTemplateError", "accept", "build_tree", "chain_tree", "decode", "encode_prompt", "eos_token_ids",
    "load_model", "load_template", "run",
]

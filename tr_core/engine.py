"""A loaded model with its tokenizer, one decoding method and the Token Recycling matrix it keeps between requests.

    engine = Engine.load(None, EngineConfig(method="tr", tree="paper"))
    result = engine.generate("Tell me a story.", max_new_tokens=64)
    for event in engine.stream("Another one.", 64): ...   # the matrix learned above is used here: hot start
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .decoding import DecodeResult, Drafter, decode, run
from .drafters import PlainDrafter, PromptLookupDrafter, RecyclingDrafter
from .events import StepEvent
from .matrix import AdjacencyMatrix
from .models import encode_prompt, eos_token_ids, load_model
from .text import TokenText
from .tree import TreeBuffers, load_template

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
TREE_DIRS = (ASSETS_DIR / "trees",)
METHODS = ("plain", "pld", "tr")


@dataclass(frozen=True)
class EngineConfig:
    method: str = "tr"
    tree: str = "paper"  # Token Recycling: a template name or .json file
    top_k: int = 8  # Token Recycling: candidates per matrix row
    matrix_path: str | None = None  # Token Recycling: hot-start file; None = cold start
    seed_from_prompt: bool = False  # Token Recycling: fill rows from the prompt's prefill logits
    pld_max_ngram: int = 3
    pld_max_draft: int = 10

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 1 <= self.top_k <= 64:
            raise ValueError(f"top_k must be between 1 and 64, got {self.top_k}")
        tree = self.tree_buffers()
        if tree.max_rank >= self.top_k:
            raise ValueError(f"tree {tree.name!r} uses rank {tree.max_rank}, which needs top_k >= "
                             f"{tree.max_rank + 1}; top_k is {self.top_k}")

    def tree_buffers(self) -> TreeBuffers:
        return load_template(self.tree, TREE_DIRS)


class Engine:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: EngineConfig = EngineConfig()):
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.config = config
        self.tree = config.tree_buffers()
        self.matrix = self.fresh_matrix()

    @classmethod
    def load(cls, model_id: str | None = None, config: EngineConfig = EngineConfig(),
             dtype: torch.dtype = torch.float32) -> "Engine":
        model, tokenizer = load_model(model_id, dtype=dtype)
        return cls(model, tokenizer, config)

    def fresh_matrix(self) -> AdjacencyMatrix:
        """The starting matrix: the hot-start file if the config names one, else an empty (cold) matrix."""
        device = self.model.device
        if self.config.matrix_path:
            return AdjacencyMatrix.load(self.config.matrix_path, self.vocab_size, self.config.top_k, device)
        return AdjacencyMatrix(self.vocab_size, self.config.top_k, device)

    def with_config(self, **changes) -> "Engine":
        """Another engine on the same loaded model with some settings changed (and its own matrix)."""
        return Engine(self.model, self.tokenizer, replace(self.config, **changes))

    def drafter(self, method: str | None = None) -> Drafter:
        method = method or self.config.method
        if method == "plain":
            return PlainDrafter()
        if method == "pld":
            return PromptLookupDrafter(self.config.pld_max_ngram, 1, self.config.pld_max_draft)
        if method == "tr":
            return RecyclingDrafter(self.matrix, self.tree, self.config.seed_from_prompt)
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, use_chat_template=None if chat else False)

    def stream(self, prompt: str | list[int], max_new_tokens: int, method: str | None = None,
               chat: bool = True) -> Iterator[StepEvent]:
        ids = prompt if isinstance(prompt, list) else self.encode(prompt, chat)
        return decode(self.model, ids, self.drafter(method), max_new_tokens, self.eos_ids, TokenText(self.tokenizer))

    def generate(self, prompt: str | list[int], max_new_tokens: int, method: str | None = None,
                 chat: bool = True) -> DecodeResult:
        ids = prompt if isinstance(prompt, list) else self.encode(prompt, chat)
        return run(self.model, ids, self.drafter(method), max_new_tokens, self.eos_ids, TokenText(self.tokenizer))

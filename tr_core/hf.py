"""Token Recycling inside transformers' own ``generate``: pass ``custom_generate=token_recycling``.

    from tr_core.hf import token_recycling
    out = model.generate(**inputs, custom_generate=token_recycling, max_new_tokens=64)
    out = model.generate(**inputs, custom_generate=token_recycling, method="tr-context", do_sample=True, top_p=0.9)

transformers prepares the inputs, the generation config, the logits processors and the stopping criteria as for any
decoding, then calls ``token_recycling`` in place of its own loop (``GenerationMixin.generate``); keyword arguments
``generate`` does not know (``method``, ``tree``, ``matrix_k``, ``recycler``, ``seed``) are handed to it. It decodes
with this project's engine (``engine.Engine``: its CPU kernels, or the torch backend on a GPU) and returns what
``generate`` returns: the prompt and the new tokens, or a ``GenerateDecoderOnlyOutput`` with
``return_dict_in_generate=True``.

What it keeps exact: greedy output is this project's plain decoding's, token for token; sampling (``do_sample`` with
``temperature``, ``top_k``, ``top_p``) is this project's exact sampling (``sampling.py``: every method samples what
plain sampling samples, from a seed: ``seed=`` or, by default, one drawn from torch's global generator, so
``torch.manual_seed`` before ``generate`` repeats a run). Stopping criteria are asked after every new token, so a
step that accepted several stops where plain decoding would have; a streamer receives each step's tokens as the step
accepts them. What it cannot do exactly is refused with a ValueError that names it: a batch of more than one row,
padding, beams, several sequences a prompt, scores or attentions in the output, a logits processor other than
temperature, top-k and top-p (it would have to be applied to every draft node), a cache handed in.

The adjacency matrix lives in a ``Recycler``: one per model unless one is passed (``recycler=``), carried from call
to call (the paper's hot start), saved and loaded with ``Recycler.save`` / ``Recycler.load``. A new one starts from
the matrix shipped for the embedded model, else empty.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.utils import GenerateDecoderOnlyOutput, GenerationMixin

from .decoding import decode
from .engine import Engine, EngineConfig
from .matrix import AdjacencyMatrix
from .methods import check as check_method
from .sampling import Sampling

# model kwargs transformers prepares for every decoding, which this loop does not need (its cache is its own)
PREPARED = {"attention_mask", "position_ids", "logits_to_keep", "cache", "past_key_values", "use_cache"}
REFUSED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


@dataclass
class Recycler:
    """One model's Token Recycling between ``generate`` calls: the engine built on it (its kernels chosen once) and
    the adjacency ``matrix`` every call drafts from and teaches."""

    model: PreTrainedModel
    matrix_k: int = 8
    matrix: AdjacencyMatrix | None = None
    backend: str = "auto"  # the engine's backend: auto (native on a CPU, torch on a GPU), native or torch
    engines: dict = field(default_factory=dict, repr=False)
    attention: tuple[str, str] | None = None  # the model's attention implementation: its own, and the engine's

    def engine(self, tree: str | None = None, mode: str = "exact") -> Engine:
        """The engine for ``tree`` (None: the engine's default, fitted to this machine) and ``mode``, built once;
        its matrix is this recycler's (the shipped hot start for the embedded model, else empty, at first)."""
        key = (tree, mode)
        if key not in self.engines:
            config = EngineConfig(mode=mode, top_k=self.matrix_k, device=str(self.model.device), backend=self.backend,
                                  **({} if tree is None else {"tree": tree}))
            own = self.model.config._attn_implementation
            base = Engine(self.model, SimpleNamespace(eos_token_id=None, chat_template=None), config)
            # the torch backend registers its attention as the model's: the model gets its own back between calls
            self.attention = (own, self.model.config._attn_implementation)
            set_attention(self.model, own)
            if self.matrix is None:
                hot = base.shipped_matrix_path()
                self.matrix = (AdjacencyMatrix.load(hot, base.vocab_size, self.matrix_k, self.model.device) if hot
                               else base.fresh_matrix())
            self.engines[key] = base
        return self.engines[key].with_matrix(self.matrix)

    def save(self, path: str | Path) -> None:
        """The matrix to a safetensors file (``Recycler.load`` starts another recycler from it)."""
        if self.matrix is None:
            raise ValueError("this recycler has no matrix yet: it gets one at its first generate call")
        self.matrix.save(path, {"model": str(getattr(self.model.config, "_name_or_path", ""))})

    @classmethod
    def load(cls, model: PreTrainedModel, path: str | Path, matrix_k: int = 8) -> "Recycler":
        vocab = model.get_output_embeddings().weight.shape[0]
        return cls(model, matrix_k, AdjacencyMatrix.load(path, vocab, matrix_k, model.device))


_RECYCLERS: "weakref.WeakKeyDictionary[PreTrainedModel, Recycler]" = weakref.WeakKeyDictionary()


def recycler_of(model: PreTrainedModel, matrix_k: int = 8) -> Recycler:
    """The recycler a model's ``generate`` calls share where none is passed (one per model and k)."""
    held = _RECYCLERS.get(model)
    if held is None or held.matrix_k != matrix_k:
        held = _RECYCLERS[model] = Recycler(model, matrix_k)
    return held


def _refuse(input_ids: torch.Tensor, config: GenerationConfig, synced_gpus: bool, model_kwargs: dict) -> None:
    """A ValueError naming what ``generate`` was asked that this loop cannot do exactly."""
    def no(what: str) -> ValueError:
        return ValueError(f"Token Recycling's generate cannot do {what} exactly; call generate without "
                          "custom_generate for it")
    if (config.num_beams or 1) > 1:  # (before the batch: generate has repeated the prompt once a beam)
        raise no(f"beam search (num_beams={config.num_beams})")
    if (config.num_return_sequences or 1) > 1:
        raise no(f"several sequences a prompt (num_return_sequences={config.num_return_sequences})")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise no(f"a batch of {input_ids.shape[0]} rows (it decodes one sequence: call it once a row)")
    for name in REFUSED_OUTPUTS:
        if getattr(config, name, False):
            raise no(f"{name}=True (it returns the sequences only)")
    if synced_gpus:
        raise no("synced_gpus")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise no("a padded input (an attention mask with zeros)")
    for cache_key in ("cache", "past_key_values"):
        cache = model_kwargs.get(cache_key)
        if cache is not None and cache.get_seq_length() > 0:
            raise no("a cache handed in (it fills its own)")
    extra = sorted(k for k, v in model_kwargs.items() if k not in PREPARED and v is not None)
    if extra:
        raise no(f"the model inputs {', '.join(extra)}")


def sampling_of(config: GenerationConfig, processors, seed: int | None) -> Sampling | None:
    """This project's ``Sampling`` for what ``generate`` prepared: None (greedy) without ``do_sample``; else the
    temperature, top-k and top-p of the warpers in ``processors`` (the config's, and any the caller passed: read
    from the warpers themselves, one of each at most), in this project's order (temperature, then top-k, then
    top-p, as transformers applies them). Any other processor, or a second warper of a kind, is refused, by name."""
    kept = {TemperatureLogitsWarper: "temperature", TopKLogitsWarper: "top_k", TopPLogitsWarper: "top_p"}
    found = {}
    for p in processors or ():
        field_ = kept.get(type(p))
        if field_ is None or not config.do_sample or field_ in found:
            raise ValueError(f"Token Recycling's generate cannot apply the logits processor {type(p).__name__} "
                             "exactly (to every draft node)" + (" a second time" if field_ in found else "")
                             + "; call generate without custom_generate for it")
        found[field_] = getattr(p, field_)
    if not config.do_sample:
        return None
    if seed is None:
        seed = int(torch.randint(0, 2 ** 62, (1,)))  # from torch's global generator: manual_seed repeats it
    return Sampling(temperature=float(found.get("temperature", 1.0)), top_p=float(found.get("top_p", 1.0)),
                    sample_top_k=int(found.get("top_k", 0)), seed=seed)


def _streamer_of_generate():
    """The ``streamer`` given to ``generate``: transformers 5 puts the prompt into it, then calls a
    ``custom_generate`` callable without it (only the callable's own extra arguments are handed over), so it is read
    from ``generate``'s frame."""
    code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = inspect.currentframe()
    for _ in range(8):
        frame = frame.f_back if frame is not None else None
        if frame is not None and frame.f_code is code:
            return frame.f_locals.get("streamer")
    return None


@torch.no_grad()
def token_recycling(model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor=None,
                    stopping_criteria=None, generation_config: GenerationConfig | None = None,
                    synced_gpus: bool = False, streamer=None, method: str = "tr", tree: str | None = None,
                    matrix_k: int = 8, recycler: Recycler | None = None, seed: int | None = None,
                    mode: str = "exact", **model_kwargs):
    """The decoding loop ``model.generate(..., custom_generate=token_recycling)`` runs (the module docstring says
    what it does and refuses). ``method``: any method of ``methods.METHODS`` ("tr", "tr-context", "pld", "plain",
    ...); ``tree``: the draft tree ("auto", "paper", "small", ...; None: the engine's default); ``matrix_k``: the
    candidates each matrix row keeps; ``recycler``: whose matrix to draft from and teach (None: the model's own);
    ``seed``: the sampling seed; ``mode``: the engine's kernels ("exact" keeps the model's fp32 numbers)."""
    config = generation_config or model.generation_config
    _refuse(input_ids, config, synced_gpus, model_kwargs)
    sampling = sampling_of(config, logits_processor, seed)
    streamer = streamer if streamer is not None else _streamer_of_generate()
    check_method(method)
    prompt = input_ids[0].tolist()
    budget = (config.max_length or len(prompt) + 20) - len(prompt)
    eos = config.eos_token_id
    eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
    held = recycler or recycler_of(model, matrix_k)
    if held.model is not model:
        raise ValueError("this recycler was made for another model: make one for this model (Recycler(model))")
    new: list[int] = []
    if budget > 0:
        own = model.config._attn_implementation
        engine = held.engine(tree, mode)
        ours = held.attention[1]
        set_attention(model, ours)
        try:
            for event in decode(model, prompt, engine.drafter(method), budget, eos_ids, None, engine.head, sampling,
                                engine.backend):
                step, done = _stop_within(event.new_tokens, prompt + new, stopping_criteria, input_ids.device)
                new += step
                if streamer is not None and step:
                    streamer.put(torch.tensor(step))
                if done:
                    break
        finally:
            set_attention(model, own)  # the model's own generate, after this call, runs as it did before
    if streamer is not None:
        streamer.end()
    sequences = torch.cat([input_ids, torch.tensor([new], dtype=input_ids.dtype, device=input_ids.device)], dim=1)
    if config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def set_attention(model: PreTrainedModel, name: str) -> None:
    """Make ``model`` (and its sub-models' configs, a multimodal model's text part) attend with the implementation
    transformers registered as ``name``."""
    model.config._attn_implementation = name
    for sub in model.modules():
        config = getattr(sub, "config", None)
        if config is not None and config is not model.config and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name


def _stop_within(tokens: list[int], before: list[int], criteria, device: torch.device) -> tuple[list[int], bool]:
    """``tokens`` (a step's) up to the first after which ``criteria`` (transformers' stopping criteria, asked
    with the sequence so far and no scores) say stop, and whether they did."""
    if not criteria:
        return tokens, False
    for i in range(len(tokens)):
        sequence = torch.tensor([before + tokens[:i + 1]], dtype=torch.long, device=device)
        if bool(criteria(sequence, None).any()):
            return tokens[:i + 1], True
    return tokens, False

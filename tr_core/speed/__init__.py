"""How fast a model runs on this machine, behind two questions the algorithm asks:

- what mode and kernels a model runs in: ``prepare_model(model, mode)`` puts its linear layers on the matmul layouts
  measured fastest among those found row-invariant here (``layouts``, ``kernels``), ``mode_dtype`` says in a
  sentence what that is; the lean forward (``lean``) and its batch-invariant attention (``attention``) run them,
  on a preallocated KV cache (``kv``);
- what a step of N tokens costs: ``context_curve(model, context)``, t(N) measured here (``calibrate``), and
  ``machine_profile(model)``, what the step-cost model of ``tr_core.projection`` needs of this machine.

The algorithm (``tr_core``'s top-level modules) imports from this package only, never from its modules.
"""

from importlib import import_module

from .attention import window_room
from .chooser import prepare_model
from .kernels import (
    MODES,
    OutputHead,
    body,
    cache_dtype,
    feed,
    grouped_query_attention_in_sdpa,
    kernel_summary,
    mode_dtype,
    window,
)
from .kv import keep_accepted_path, new_cache
from .layouts import cpu_name

# the calibration measures whole steps (it imports the lean forward and the kernels): loaded on first use
_LAZY = {"DEFAULT_FIT_CONTEXT": "calibrate", "context_curve": "calibrate", "interpolate": "calibrate",
         "machine_key": "calibrate", "machine_profile": "calibrate"}  # (the first and third live in tr_core.modes)

__all__ = ["MODES", "OutputHead", "body", "cache_dtype", "cpu_name", "feed", "grouped_query_attention_in_sdpa",
           "kernel_summary", "keep_accepted_path", "mode_dtype", "new_cache", "prepare_model", "window", "window_room",
           *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'tr_core.speed' has no attribute {name!r}")

"""The seam between the decoding loop and the model's arithmetic: what a decoding asks of a backend.

    backend = make_backend(model, "auto")         # "native" on a CPU, "torch" on any other device
    run = backend.start(prompt_len, max_new_tokens)
    hidden = run.prefill(ids)                     # the prompt (but its root) into the run's cache; (p, d)
    logits = run.verify(tokens, tree, past_len)   # one forward pass over a draft tree; (n, V)
    run.keep(past_len, tree.size, path)           # the cache keeps the accepted path only

Two implementations, each in its own room: ``speed.NativeBackend`` (this project's CPU kernels: the lean forward,
the batch-invariant attention, the kernel plan chosen by measurement) and ``fixed.TorchBackend`` (stock torch
operations at one shape for the whole run, on any device, captured as one CUDA graph a step on a GPU). Neither
imports the decoding loop.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from transformers import PreTrainedModel

from .machine import cpu_name, device_name  # noqa: F401 (the seam offers them)
from .modes import DEFAULT_FIT_CONTEXT, MODES, interpolate, torch_dtype  # noqa: F401 (the seam offers them)
from .tree import TreeBuffers

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
BACKENDS = ("auto", "native", "torch")


class Run(Protocol):
    """One decoding's model state: a KV cache holding the sequence but its last token (the root)."""

    max_nodes: int | None  # the most draft-tree nodes one pass takes (None: any)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` (p,) into the cache, after what it holds; their final hidden states (p, d)."""

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer: hidden states (n, d) -> logits (n, V)."""

    def verify(self, tokens: torch.Tensor, tree: TreeBuffers, past_len: int) -> torch.Tensor:
        """One forward pass over a draft tree's ``tokens`` (n,) on ``past_len`` cached positions: its logits (n, V).
        The tree's nodes enter the cache after the cached positions; ``keep`` then keeps the accepted ones."""

    def keep(self, past_len: int, tree_size: int, path: torch.Tensor) -> None:
        """After ``verify``: the cache keeps the nodes of the accepted ``path`` (a + 1,) at positions past_len ..."""

    def room(self, past_len: int) -> tuple[int, str] | None:
        """The deepest tree a pass may verify on ``past_len`` cached positions, and why (None: no limit)."""


class Backend(Protocol):
    name: str  # "native" or "torch"
    device: torch.device

    def start(self, prompt_len: int, max_new_tokens: int) -> Run:
        """A run for a prompt of ``prompt_len`` tokens and up to ``max_new_tokens`` more."""

    def describe(self) -> str:
        """One sentence: the backend, the device and what it runs there."""


def add_device_arguments(parser) -> None:
    """``--device``, ``--backend`` and ``--rows``, as the command line and the benchmark take them."""
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA where torch sees one, else the CPU), cpu, cuda or cuda:N")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="native: this project's CPU kernels; torch: fixed shapes on any device (one CUDA graph "
                             "a step on a GPU); auto: native on a CPU, torch elsewhere")
    parser.add_argument("--rows", type=int, default=None,
                        help="torch backend: query rows of every pass (default: the size of the tree the chooser "
                             "fits on the backend's t(N) measured there, rounded up to 8)")


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """``"auto"`` (or None): the first CUDA device where torch sees one, else the CPU; ``"cpu"``, ``"cuda"``,
    ``"cuda:N"`` or any torch device name as it is, checked here so that a bad one fails with one clear message.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    if spec is None or spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {spec!r}: choose auto, cpu, cuda or cuda:N ({e})") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r}: torch sees no CUDA device here (torch {torch.__version__}, "
                             f"CUDA build {torch.version.cuda or 'none'}); use --device cpu or auto")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def resolve_backend(spec: str | None, device: torch.device) -> str:
    """``"auto"`` (or None): ``"native"`` on a CPU, ``"torch"`` on any other device; else the name, checked.

    >>> resolve_backend("auto", torch.device("cpu")), resolve_backend("torch", torch.device("cpu"))
    ('native', 'torch')
    """
    if spec is None or spec == "auto":
        return "native" if device.type == "cpu" else "torch"
    if spec not in ("native", "torch"):
        raise ValueError(f"unknown backend {spec!r}: choose auto, native or torch")
    if spec == "native" and device.type != "cpu":
        raise ValueError(f"the native backend runs on the CPU only (its kernels are C for x86/ARM cores); "
                         f"device {device} needs --backend torch (or auto)")
    return spec


def make_backend(model: PreTrainedModel, kind: str = "auto", rows: int | None = None, head=None) -> Backend:
    """The backend ``kind`` (``resolve_backend``) for ``model`` on its device: the one place a backend is chosen.
    ``rows``: the torch backend's query rows a pass (every pass of its runs has that many; None:
    ``fixed.default_rows``); ``head``: the native backend's output layer, made once per model by a caller that
    decodes many prompts (``speed.OutputHead``; None: made here). Each backend is imported where it is chosen: a
    machine uses one."""
    name = resolve_backend(kind, model.device)
    if name == "native":
        from .speed.backend import NativeBackend
        return NativeBackend(model, head)
    from .fixed import TorchBackend
    return TorchBackend(model, rows)


# --- what the engine asks of a backend before its first run ----------------------------------------------------------
# The model's preparation, its dtype, its output layer and its step-time curve, per backend: each answered by that
# backend's room, imported where asked (a machine uses one).


def load_dtype(name: str, mode: str) -> torch.dtype:
    """The dtype backend ``name`` loads a model in for ``mode``: fp32 on the native backend (the fast mode measures
    its formats on the fp32 model and converts it where it chooses so), ``torch_dtype`` on the torch backend."""
    if name == "native":
        from .speed import mode_dtype
        return mode_dtype(mode)[0]
    return torch_dtype(mode)


def prepare(model: PreTrainedModel, name: str, mode: str):
    """Put ``model`` on backend ``name``'s kernels for ``mode`` (in place; idempotent: on the native backend the
    kernel plan is measured on this machine the first time, then cached) and return its output layer, a callable
    hidden states (n, d) -> logits (n, V) that computes only the rows it is given."""
    if name == "native":
        from .speed import OutputHead, prepare_model
        prepare_model(model, mode)
        return OutputHead(model)
    from .fixed import OutputLayer
    return OutputLayer(model)


def step_curve(model: PreTrainedModel, name: str, context: int | tuple[int, ...] = DEFAULT_FIT_CONTEXT
               ) -> dict[int, float]:
    """t(N), the ms of a step verifying N tokens, of backend ``name`` on this machine over a ``context``-token cache
    (several: averaged over them; the torch backend: at their mean), measured once and cached per machine."""
    if name == "native":
        from .speed import context_curve
        return context_curve(model, context)
    from .fixed.timing import rows_curve
    prefix = context if isinstance(context, int) else round(sum(context) / len(context))
    return rows_curve(model, prefix)


def pass_rows(model: PreTrainedModel, tree_size: int | None) -> int:
    """The torch backend's query rows a pass for trees of ``tree_size`` nodes: rounded up to its tile; None: its
    default on the model's device."""
    from .fixed import TILE, default_rows, round_up
    return default_rows(model.device) if tree_size is None else round_up(tree_size, TILE)


# --- what the app asks of this machine and of the kernels a model runs on --------------------------------------------
# Through the seam, so that ``ui/`` and ``app.py`` import nothing from a backend's room. Each question is answered by
# the native backend's room (``speed``), imported where asked: it loads this project's C kernels, which a run on a
# GPU never needs.


def mode_note(mode: str, model: PreTrainedModel | None = None) -> str:
    """What ``mode`` runs ``model`` in on this machine, in a sentence (the kernels' format, or why fp32 stayed)."""
    from .speed import mode_dtype
    return mode_dtype(mode, model)[1]


def kernel_summary(model: PreTrainedModel) -> str:
    """The kernels ``model`` runs on here, in a sentence."""
    from .speed import kernel_summary as summary
    return summary(model)


def parameter_count(model: PreTrainedModel) -> int:
    """The model's parameters, each counted once (a tied output layer once)."""
    from .speed.kernels import parameter_count as count
    return count(model)


def machine_key(model: PreTrainedModel) -> str:
    """A file name for this machine and model: what measurements are cached under."""
    from .speed import machine_key as key
    return key(model)


def machine_profile(model: PreTrainedModel, context) -> dict:
    """What the step-cost model of ``tr_core.projection`` needs of this machine and model."""
    from .speed import machine_profile as profile
    return profile(model, context)


@contextlib.contextmanager
def every_mode_at_once():
    """Within it, the first model prepared on the CPU times the kernel candidates of every mode in one measurement
    (``speed.layouts.every_mode_at_once``): for a caller that prepares both modes, as the app does at its start."""
    from .speed.layouts import every_mode_at_once as at_once
    with at_once():
        yield


def runnable_threads() -> int | None:
    """Threads ready to run on this machine now (the kernel's count), None where it cannot be read."""
    from .speed.layouts import runnable_threads as runnable
    return runnable()


def machine_busy(samples: list[int]) -> bool:
    """Whether other work competed for the cores while ``samples`` (``runnable_threads`` readings) were taken."""
    from .speed.layouts import machine_busy as busy
    return busy(samples)

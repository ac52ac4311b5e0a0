"""The app on GPU hardware, checked on a CPU: ZeroGPU's decorator leaves the handlers as they are off ZeroGPU, its
durations follow a request's size, and a run says where it decodes."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch

from ui import gpu


def test_the_zero_gpu_decorator_is_a_no_op_off_zero_gpu(monkeypatch):
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert gpu.spaces is not None  # pinned in requirements.txt

    def handler(session, **values):
        yield values

    assert gpu.on_gpu(gpu.live_seconds)(handler) is handler
    import app  # the decoding handlers, decorated: still the generators gradio streams from
    for name in ("live", "race"):
        inner = getattr(app.Handlers, name).__wrapped__
        assert inspect.isgeneratorfunction(inner) and inner.__name__ == name


def test_gpu_seconds_grow_with_the_request_and_stay_within_zero_gpus_bounds():
    from ui.run import RACE_ROUNDS

    assert gpu.RACE_ROUNDS == RACE_ROUNDS
    assert gpu.live_seconds(max_new_tokens=64) <= gpu.live_seconds(max_new_tokens=512)
    assert gpu.race_seconds(max_new_tokens=128, race_methods=["pld"]) < gpu.race_seconds(
        max_new_tokens=128, race_methods=["pld", "tr", "tr-context", "lookahead"])
    for seconds in (gpu.live_seconds(max_new_tokens=10**6), gpu.race_seconds(max_new_tokens="x"),
                    gpu.live_seconds()):
        assert gpu.MIN_S <= seconds <= gpu.MAX_S


def test_a_run_says_it_decodes_on_the_cpu_when_no_cuda_is_seen(monkeypatch):
    from tr_core.backend import resolve_device
    from ui.run import where

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    device = resolve_device("auto")
    engine = SimpleNamespace(model=SimpleNamespace(device=device), backend_name="native", backend=None)
    assert where(engine).startswith("runs on the CPU (")
    engine.backend_name = "torch"
    assert where(engine).endswith(", torch backend)")


def test_the_app_imports_spaces_before_torch():
    """ZeroGPU's ``spaces`` must come in before torch: ``app.py`` imports ``ui.gpu`` first (a fresh interpreter
    records the order in which the top-level packages were first imported)."""
    import subprocess
    import sys

    probe = ("import sys, builtins\norder = []\nreal = builtins.__import__\n"
             "def imp(name, *a, **k):\n    top = name.split('.')[0]\n"
             "    if top in ('spaces', 'torch') and top not in order: order.append(top)\n"
             "    return real(name, *a, **k)\nbuiltins.__import__ = imp\nimport app\nprint(','.join(order))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1].startswith("spaces,torch"), out.stdout[-300:]

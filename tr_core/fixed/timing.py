"""t(N) for the torch backend, measured where it runs: a pass of R rows (R = N rounded up to ``TILE``; for N = 1,
plain decoding unpadded, the baseline a tree must beat) on top of a
``prefix``-token cache, the output layer and the choice over the vocabulary included, as the decoding loop times a
step (``forward_ms``). Cached per machine: the device's name, the model's shape and dtype, torch's version.

Every pass of a run has the same rows, so a run's steps all cost t(R) whatever tree they verify: the chooser
(``fitting.fit_tree``) fits a size N on this curve and the engine runs with R = N rounded up (``Engine.rows``).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from transformers import PreTrainedModel

from ..cachefiles import write_atomically
from ..machine import device_name
from ..models import default_cache_dir, file_name
from ..topk import greedy_and_top_k
from ..tree import build_tree, chain_tree, load_template
from . import backend, graph, rows
from .backend import TILE, TorchBackend, round_up
from .rows import window_start

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 81, 96, 128)  # draft-tree sizes t(N) is measured for (nodes)
CPU_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)  # on a CPU, where a pass's cost grows fast with its rows


def _code() -> str:
    """A digest of the code a pass runs and this measurement (a change measures anew)."""
    digest = hashlib.sha256()
    for module in (backend, graph, rows, sys.modules[__name__]):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:10]


def machine_key(model: PreTrainedModel, prefix: int) -> str:
    config = model.config
    shape = "x".join(str(getattr(config, k, "")) for k in ("num_hidden_layers", "hidden_size", "vocab_size"))
    dtype = str(model.dtype).removeprefix("torch.")
    return file_name(f"torch-{device_name(model.device)}-{shape}-{dtype}-torch{torch.__version__}"
                     f"-t{torch.get_num_threads()}-p{prefix}-{_code()}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing_tree(n: int):
    """The tree of ``n`` nodes a step of t(N) verifies: the paper tree's first ``n`` nodes; past its 81, the paper
    tree grown a level at a time, each leaf (in BFS order) given a child (rank 0), so every size has its own tree.

    >>> [timing_tree(n).size for n in (1, 2, 81, 96, 128, 300)]
    [1, 2, 81, 96, 128, 300]
    """
    if n == 1:
        return chain_tree(0)
    paths = list(load_template("paper").node_paths[1:])
    while len(paths) < n - 1:
        below = {p[:-1] for p in paths}
        leaves = [p for p in paths if p not in below]
        paths += [leaf + (0,) for leaf in leaves[:n - 1 - len(paths)]]
    return build_tree(paths[:n - 1], name=f"first{n}")


@torch.inference_mode()
def time_rows(model: PreTrainedModel, rows: int, n: int, prefix: int, repeats: int = 5) -> float:
    """Median ms of a step verifying ``n`` nodes (``timing_tree(n)``) on a run of ``rows`` rows (1: unpadded)."""
    backend = TorchBackend(model, rows)
    assert backend.rows == rows, (backend.rows, rows)  # the label says what ran
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    run = backend.start(prefix + n, 1)
    run.state.kv.normal_()  # a ``prefix``-token cache (what is in it does not change a pass's time; no prefill)
    tree = timing_tree(n)
    tokens = torch.randint(0, vocab, (n,), generator=g).to(model.device)
    times = []
    for i in range(repeats + 2):  # two uncounted: the capture (on CUDA) and a warm pass
        _sync(model.device)
        t0 = time.perf_counter()
        logits = run.verify(tokens, tree, prefix)
        greedy_and_top_k(logits, 8 if n > 1 else 0)
        _sync(model.device)
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def rows_curve(model: PreTrainedModel, prefix: int = 256, sizes: Sequence[int] | None = None,
               repeats: int = 5, use_cache_file: bool = True) -> dict[int, float]:
    """t(N) (ms) for the torch backend on ``model``'s device: N nodes on a pass of round_up(N, TILE) rows, made
    non-decreasing in N. Cached per machine (``machine_key``)."""
    if sizes is None:
        sizes = CPU_SIZES if model.device.type == "cpu" else SIZES
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos:
        prefix = max(1, min(prefix, max_pos - round_up(max(sizes), TILE) - 2))
    prefix = window_start(prefix)  # a window's first position: room for any tree's depth (the cost is the same)
    path = default_cache_dir() / "calibration" / f"{machine_key(model, prefix)}.json"
    if use_cache_file and path.is_file():
        cached = {int(k): v for k, v in json.loads(path.read_text()).items()}
        if all(n in cached for n in sizes):
            return {n: cached[n] for n in sizes}
    curve, running = {}, 0.0
    for n in sorted(sizes):
        rows = 1 if n == 1 else round_up(n, TILE)  # plain decoding's baseline: one row, unpadded
        running = max(running, time_rows(model, rows, n, prefix, repeats))  # a dip is noise
        curve[n] = running
    if use_cache_file:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(curve, indent=1))
    return curve

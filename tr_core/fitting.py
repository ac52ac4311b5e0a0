"""The tree fitted to a model on this machine: from the shipped acceptance statistics (how often each node of the
paper's tree lay on the accepted path) and the calibrated step times t(N) (``speed.calibrate``), the prefix of the
nodes, likeliest first, with the most expected tokens per second (``fit_tree``, ``auto_tree``)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from transformers import PreTrainedModel

from .assets import ACCEPTANCE_DIR, acceptance_path, model_slug
from .backend import DEFAULT_FIT_CONTEXT, interpolate, step_curve
from .tree import TreeBuffers, build_tree


def node_acceptance(events: list, tree: TreeBuffers) -> list[float]:
    """For every node of ``tree``, the share of steps in which it lay on the accepted path (root = 1.0)."""
    counts = [0] * tree.size
    steps = 0
    for e in events:
        if e.tree_name != tree.name or len(e.tree_tokens) != tree.size:
            continue
        steps += 1
        for node in e.accepted_path:
            counts[node] += 1
    if not steps:
        raise ValueError(f"no steps with tree {tree.name!r} to count acceptance from")
    return [c / steps for c in counts]


@dataclass
class FittedTree:
    tree: TreeBuffers
    expected_accepted: float  # expected tokens per step, bonus included
    predicted_speedup: float  # over plain decoding, from t(N) and the overhead
    table: list[dict]  # one row per candidate size: nodes, expected_accepted, step_ms, predicted_speedup
    context: int | tuple[int, ...] | None = None  # the context length(s) (tokens) t(N) was calibrated on


def size_factors(acceptance: list[float], measured: dict[int, float]) -> dict[int, float]:
    """How much of the acceptance statistics' promise a tree of N nodes kept when it ran: ``measured`` maps N (nodes,
    root included) to the mean accepted tokens per step measured with the N likeliest nodes themselves; the factor
    is (measured - 1) / (expected - 1), the draft tokens accepted against those expected from ``acceptance``.

    A small tree refreshes few matrix rows a step, so its matrix is staler than the one the statistics were
    gathered with (the paper's 81 nodes), and its nodes are accepted less often than the statistics say.

    >>> size_factors([1.0, 0.5, 0.25, 0.25], {2: 1.4, 4: 1.8})
    {2: 0.8, 4: 0.8}
    """
    ordered = [1.0] + sorted(acceptance[1:], reverse=True)
    factors = {}
    for n, mat in sorted(measured.items()):
        promised = sum(ordered[1:n])
        if promised > 0:
            factors[int(n)] = round((mat - 1.0) / promised, 4)
    return factors


def size_factor(factors: dict[int, float], n: int, full: int = 81) -> float:
    """The factor at ``n`` nodes, interpolated in log N between the measured sizes, and towards 1 at the statistics'
    own tree of ``full`` nodes; 1 where nothing was measured.

    >>> size_factor({2: 0.6, 8: 0.9}, 4), size_factor({2: 0.6}, 1), size_factor({}, 5)
    (0.75, 0.6, 1.0)
    """
    if not factors:
        return 1.0
    points = sorted({**{full: 1.0}, **factors}.items()) if max(factors) < full else sorted(factors.items())
    if n <= points[0][0]:
        return points[0][1]
    for (a, fa), (b, fb) in zip(points, points[1:]):
        if n <= b:
            w = (math.log(n) - math.log(a)) / (math.log(b) - math.log(a))
            return fa + w * (fb - fa)
    return points[-1][1]


def fit_tree(source: TreeBuffers, acceptance: list[float], curve: dict[int, float],
             overhead_ms: float = 0.0, name: str = "auto", max_nodes: int | None = None,
             size: int | None = None, factors: dict[int, float] | None = None) -> FittedTree:
    """The prefix of ``source``'s nodes, in order of acceptance, that maximises expected tokens per second (or, with
    ``size``, the prefix of that many nodes, root included). ``factors`` (``size_factors``): the share of the
    expected draft tokens that trees of each size were measured to keep; none: all of them."""
    order = sorted(range(1, source.size), key=lambda i: (-acceptance[i], i))
    plain_ms = interpolate(curve, 1) + overhead_ms
    best, table, promised = None, [], 0.0
    limit = source.size - 1 if max_nodes is None else min(max_nodes, source.size - 1)
    for count in range(0, limit + 1):
        if count:
            promised += acceptance[order[count - 1]]
        # never fewer expected tokens than a smaller tree's (measured factors carry noise)
        expected = max(1.0 + promised * size_factor(factors or {}, count + 1, source.size),
                       table[-1]["expected_accepted"] if table else 1.0)
        step_ms = interpolate(curve, count + 1) + overhead_ms
        speedup = expected / step_ms * plain_ms
        table.append({"nodes": count + 1, "expected_accepted": expected, "step_ms": step_ms,
                      "predicted_speedup": speedup})
        if best is None or speedup > best[2]:
            best = (count, expected, speedup)
    if size is not None:
        if not 1 <= size <= len(table):
            raise ValueError(f"a tree of {size} nodes cannot be cut from {source.name!r} ({source.size} nodes)")
        row = table[size - 1]
        best = (size - 1, row["expected_accepted"], row["predicted_speedup"])
    count, expected, speedup = best
    chosen = [source.node_paths[i] for i in order[:count]]
    return FittedTree(build_tree(chosen, name=name), expected, speedup, table)


def has_acceptance_stats(model: PreTrainedModel, acceptance_dir: Path = ACCEPTANCE_DIR) -> bool:
    return acceptance_path(model_slug(model), acceptance_dir).is_file()


def auto_tree(model: PreTrainedModel, acceptance_dir: Path = ACCEPTANCE_DIR, size: int | None = None,
              context: int | Sequence[int] = DEFAULT_FIT_CONTEXT, curve: dict[int, float] | None = None
              ) -> FittedTree:
    """The tree fitted to this model on this machine: shipped acceptance statistics + t(N) calibrated over a
    ``context``-token cache (or averaged over several contexts, ``context_curve``), or the ``curve`` given (a
    backend's own t(N): no tree larger than its largest measured size is fitted). With ``size``, the ``size``
    likeliest nodes instead (named ``auto-<size>``), to compare sizes."""
    path = acceptance_path(model_slug(model), acceptance_dir)
    if not path.is_file():
        raise ValueError(f"no acceptance statistics for {model_slug(model)!r} (looked for {path}); build them with "
                         "`python -m tr_core.tools.build_assets --model ...`, or choose a named tree")
    stats = json.loads(path.read_text())
    source = build_tree([tuple(p) for p in stats["node_paths"] if p], name=stats.get("tree", "source"))
    if [list(p) for p in source.node_paths] != stats["node_paths"]:
        raise ValueError(f"{path}: node_paths are not in BFS order")
    name = "auto" if size is None else f"auto-{size}"
    factors = {int(n): f for n, f in stats.get("size_factors", {}).items()}
    limit = None if curve is None else max(curve) - 1
    curve = step_curve(model, "native", context) if curve is None else curve
    fitted = fit_tree(source, stats["acceptance"], curve, name=name, size=size, factors=factors, max_nodes=limit)
    fitted.context = context
    return fitted

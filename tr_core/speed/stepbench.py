"""Timing whole decoding steps: a model's steps of N tree tokens on a cache of a given length (``StepBench``), timed
round by round so that a slow spell of the machine hits every size alike (``paired_curve``), for one model
(``calibrate.measure_forward_ms``, t(N) for the tree fitting) or several prepared copies side by side
(``whole_steps_ms``, how the kernel chooser compares formats).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
from transformers import PreTrainedModel

from ..models import max_positions
from ..modes import DEFAULT_FIT_CONTEXT
from ..topk import top_k
from ..tree import build_tree, load_template
from . import layouts, native
from .attention import BLOCK
from .backend import tree_attention
from .kernels import OutputHead, body, cache_dtype, feed, grouped_query_attention_in_sdpa, window
from .kv import new_cache


def bench_prefix(model: PreTrainedModel, sizes: Sequence[int], prefix: int) -> tuple[int, bool]:
    """The cache length t(N) is timed on, for a wanted ``prefix``, and whether the model runs the batch-invariant
    (windowed) attention, ``attention.py``."""
    max_pos = max_positions(model)
    if max_pos is not None:  # a model with a short context is calibrated on the longest cache that leaves room
        prefix = max(1, min(prefix, max_pos - max(sizes) - 1))
    windowed = window(body(model)) is not None
    if windowed and prefix >= BLOCK:  # the root at a window's start: every tree's depth fits in its window
        prefix = prefix // BLOCK * BLOCK
    elif windowed:  # a short cache: the deepest tree still in the first window
        prefix = max(1, min(prefix, BLOCK - 1 - load_template("paper").max_depth))
    return prefix, windowed


class StepBench:
    """A model's steps of N tree tokens (the first N nodes of the paper tree, with its tree mask) on top of a
    ``prefix``-token cache, set up to be timed as ``measure_forward_ms`` times them: the forward, and the argmax
    (N = 1) or every node's top-k (N > 1)."""

    @torch.inference_mode()
    def __init__(self, model: PreTrainedModel, sizes: Sequence[int], prefix: int = DEFAULT_FIT_CONTEXT):
        prefix, _ = bench_prefix(model, sizes, prefix)
        paper = load_template("paper")
        self.prefix, self.sizes = prefix, tuple(sizes)
        self.device = device = model.device
        if device.type == "cpu":
            grouped_query_attention_in_sdpa()  # as decoding does
        g = torch.Generator().manual_seed(0)
        vocab = model.get_output_embeddings().weight.shape[0]
        ctx = torch.randint(0, vocab, (1, prefix), generator=g).to(device)
        self.base, self.head = body(model), OutputHead(model)
        self.cache = new_cache(model.config, prefix + max(sizes), cache_dtype(self.base, model.dtype), device)
        feed(self.base, ctx[0], self.cache)  # as decoding does
        self.steps = []
        for n in self.sizes:
            tree = build_tree(list(paper.node_paths[1:n]), name=f"first{n}") if n > 1 else None
            ids = torch.randint(0, vocab, (1, n), generator=g).to(device)
            if tree is None:
                pos, seen = torch.tensor([[prefix]], device=device), {}
            else:
                pos = (prefix + tree.depth.to(device))[None]
                seen = tree_attention(self.base, tree.to(device), prefix, model.dtype, device)  # as decoding does
            self.steps.append((n, ids, pos, seen))

    @torch.inference_mode()
    def time_round(self, block: int) -> dict[int, list[float]]:
        """One round over the sizes: per size, a block of ``block`` counted steps in a row (ms each), as decoding runs
        them (a step after a much larger one runs on evicted caches, which decoding never sees); the block's first
        step (the switch from the size before) runs uncounted."""
        times = {}
        for n, ids, pos, seen in self.steps:
            times[n] = []
            for b in range(block + 1):
                t0 = time.perf_counter()
                hidden = self.base(input_ids=ids, position_ids=pos, cache=self.cache, use_cache=True,
                                   **seen).last_hidden_state[0]
                logits = self.head(hidden)
                if n > 1:  # a tree step also takes every node's top-k for the matrix update
                    top_k(logits, 8)
                else:
                    logits.argmax(dim=-1)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                if b:
                    times[n].append((time.perf_counter() - t0) * 1e3)
                self.cache.crop(-n)
        return times


def whole_steps_ms(models: dict[str, PreTrainedModel], sizes: Sequence[int], prefix: int = DEFAULT_FIT_CONTEXT,
                   repeats: int = 3, block: int = 2, pool: dict | None = None
                   ) -> tuple[dict[str, dict[int, float]], bool]:
    """t(N) (``paired_curve``) of each of ``models`` (name -> a prepared model), timed in turn, round by round (the
    order rotated each round), so that a slow spell of the machine hits each alike; and whether other processes
    competed for the cores meanwhile (``layouts.machine_busy``). ``chooser.choose_plan`` compares formats by it.

    ``pool``: a dict where the call keeps its benches and rounds; a later call given the same dict times ``repeats``
    more rounds of the same models (no warm-up round: the benches are warm) and returns t(N) over all the rounds of
    both, every model timed in every round."""
    pool = {} if pool is None else pool
    if not pool:  # the first reading: a warm-up round, uncounted, then ``repeats`` rounds
        pool.update(benches={name: StepBench(model, sizes, prefix) for name, model in models.items()},
                    times={name: {n: [] for n in sizes} for name in models}, order=list(models), load=[])
        counted = range(repeats + 1)
    else:
        counted = range(1, repeats + 1)
    benches, times, load = pool["benches"], pool["times"], pool["load"]
    for round_ in counted:
        for name in pool["order"]:
            got = benches[name].time_round(block)
            if round_:
                for n in sizes:
                    times[name][n].append(got[n])
            running = layouts.runnable_threads()
            if running is not None:
                load.append(running)
        pool["order"] = pool["order"][1:] + pool["order"][:1]
    return {name: paired_curve(t) for name, t in times.items()}, layouts.machine_busy(load)


def paired_curve(times: dict[int, list[list[float]]]) -> dict[int, float]:
    """t(N) from timings ``times[N][round]`` (ms, a block of steps per round): the smallest size's median over all
    rounds, times the median over rounds of each round's t(N) / t(smallest) ratio, made non-decreasing in N.

    A ratio is taken within a round, between blocks timed seconds apart, so a slow spell of the machine that spans
    rounds cancels out of it; a single slow block of the smallest size no longer lifts every size above it.

    >>> paired_curve({1: [[10.0], [20.0], [10.0]], 4: [[12.0], [24.0], [12.0]], 8: [[11.0], [22.0], [11.0]]})
    {1: 10.0, 4: 12.0, 8: 12.0}
    """
    sizes = sorted(times)
    first = times[sizes[0]]
    base = statistics.median(t for block in first for t in block)
    result, running = {}, 1.0
    for n in sizes:
        rounds = [statistics.median(b) / statistics.median(a) for a, b in zip(first, times[n]) if a and b]
        # the median, not the fastest run: decoding pays the typical cost of a step. With the fastest of 5 runs, the
        # embedded model's t(4)/t(1) came out at 1.19 (exact mode) while the benchmark's steps averaged 1.11
        running = max(running, statistics.median(rounds))  # more tokens never cost less: a dip is noise
        result[n] = base * running
    return result


ATTENTION_SIZES = (1, 4, 16, 32, 81)


def attention_pairs(model: PreTrainedModel, prefix: int, rounds: int = 8, block: int = 3,
                    switch=None) -> dict[int, tuple[float, float, float]]:
    """The amx format's whole steps with attention on the tiles against the same steps with fp32 attention, one
    model in one process, the two settings alternated round by round (``switch(on)``, default
    ``native.set_attention_on_tiles``), each round's order turned: per size of ``ATTENTION_SIZES``, (the median ms
    on the tiles, the median ms in fp32, the median of the rounds' ratios). ``model``: prepared in the fast mode. The
    setting is left as it was (with ``switch`` given: on)."""
    after = True if switch else native.attention_on_tiles() is not None
    switch = switch or native.set_attention_on_tiles
    bench = StepBench(model, ATTENTION_SIZES, prefix)
    times: dict[bool, dict[int, list[float]]] = {on: {n: [] for n in ATTENTION_SIZES} for on in (True, False)}
    try:
        for r in range(rounds + 1):
            for on in ((True, False) if r % 2 else (False, True)):
                switch(on)
                got = bench.time_round(block)
                if r:  # the first round is uncounted: the threads' start, cold caches
                    for n in ATTENTION_SIZES:
                        times[on][n].append(statistics.median(got[n]))
    finally:
        switch(after)
    med = statistics.median
    return {n: (med(times[True][n]), med(times[False][n]), med(a / b for a, b in zip(times[True][n], times[False][n])))
            for n in ATTENTION_SIZES}

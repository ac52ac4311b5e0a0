"""CUDA graphs for the torch backend: a pass of fixed shapes is captured once per run shape and replayed each step.

Kept thin on purpose: everything a captured pass computes is the eager fixed-shape pass (``backend.FixedRun``),
which runs and is tested on any device; only the capture and the replay are CUDA's own.
"""

from __future__ import annotations

from typing import Callable

import torch

WARMUP = 2  # eager calls on a side stream before the capture (CUDA's advice: lazy inits happen outside the graph)


class CapturedPass:
    """``fn`` (no arguments; reads and writes static tensors only) captured as one CUDA graph; ``replay`` runs it
    and returns the tensors its capture returned (the same objects every time, refilled)."""

    def __init__(self, fn: Callable[[], tuple[torch.Tensor, ...]], device: torch.device):
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = fn()

    def replay(self) -> tuple[torch.Tensor, ...]:
        self.graph.replay()
        return self.outputs


def can_capture(device: torch.device) -> bool:
    """Whether passes on ``device`` are captured: CUDA devices only."""
    return device.type == "cuda"

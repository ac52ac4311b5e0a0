"""What the same accepted tokens would buy on other hardware: a stated model of a decoding step's cost, a few device
profiles with their sources, and checks of the model where it can be checked. A model, not a measurement.

A forward pass over N tokens (the draft tree with its root) costs

    t(N) = launches + max(weight bytes / memory bandwidth, 2 * parameters * N / peak throughput)

(``step_ms``): the weights stream once per pass whatever N, the arithmetic grows with N, and eager PyTorch pays a
fixed cost per kernel it launches (``KERNELS_PER_LAYER`` per decoder layer). A run projected onto a device
(``project``) costs the sum of its steps' t(N), plus the host work each step measured here (drafting, matrix update:
the same code would run on that device's host; the choice over the vocabulary, argmax and top-k, is timed with the
forward pass here and left out there, as a GPU does it in microseconds); plain decoding costs one t(1) per token.
The prefill is left out on both sides: it is one pass over the prompt for every method.

    speedup = project(steps, DEVICES["A100"], shape)        # steps: [(tree nodes, tokens, host ms), ...]
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import mean
from typing import Mapping, Sequence

# Eager PyTorch launches about this many kernels per decoder layer and step (q, k, v, o, gate, up and down
# projections, two norms, rotary embedding, attention, activation, two residual adds), each costing a few
# microseconds of launch and scheduling on a GPU (assumed: LAUNCH_US)
KERNELS_PER_LAYER = 14
LAUNCH_US = 8.0


@dataclass(frozen=True)
class Device:
    """A device's figures for the step model: memory bandwidth (GB/s), peak throughput in the format it runs
    (TFLOP/s), bytes per weight in that format, the fixed cost per kernel (µs), and where the figures come from."""

    name: str
    bandwidth_gbs: float
    peak_tflops: float
    bytes_per_weight: float
    launch_us: float
    source: str


@dataclass(frozen=True)
class Shape:
    """What the step model needs of a model: its weights streamed per pass and its decoder layers."""

    parameters: float
    layers: int


DEVICES: dict[str, Device] = {
    "laptop CPU": Device("laptop CPU", 51.2, 0.36, 4, LAUNCH_US,
                         "assumed typical: 4 cores with AVX2 FMA at 2.8 GHz (32 fp32 FLOP a cycle each: 0.36 "
                         "TFLOP/s), dual-channel DDR4-3200 (2 x 8 B x 3200 MT/s = 51.2 GB/s), fp32 weights"),
    "T4": Device("T4", 320, 65, 2, LAUNCH_US, "NVIDIA T4 datasheet: 320 GB/s GDDR6, 65 TFLOP/s fp16 tensor cores; "
                                              "fp16 weights"),
    "A100": Device("A100", 2039, 312, 2, LAUNCH_US, "NVIDIA A100 80GB SXM datasheet: 2,039 GB/s HBM2e, 312 TFLOP/s "
                                                    "fp16 tensor cores (dense); fp16 weights"),
    "H100": Device("H100", 3350, 989, 2, LAUNCH_US, "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, 989 TFLOP/s fp16 "
                                                    "tensor cores (dense); fp16 weights"),
}

# The paper's headline on an A100: Token Recycling with Vicuna-7B (6.74e9 parameters, 32 layers) on Spec-Bench,
# 2.70 tokens per forward pass with its 80-draft tree, 2.03x over plain decoding (arXiv 2408.08696)
PAPER = {"shape": Shape(6.74e9, 32), "tokens_per_pass": 2.70, "tree_nodes": 81, "speedup": 2.03, "device": "A100"}


def step_ms(device: Device, shape: Shape, n: int) -> float:
    """The modelled time of a forward pass over ``n`` tokens, in ms.

    >>> a100, vicuna = DEVICES["A100"], Shape(6.74e9, 32)
    >>> round(step_ms(a100, vicuna, 1), 3), round(step_ms(a100, vicuna, 81), 3)   # 3.584 launches + 6.611 streaming
    (10.195, 10.195)
    """
    launches = shape.layers * KERNELS_PER_LAYER * device.launch_us / 1e3
    stream = shape.parameters * device.bytes_per_weight / (device.bandwidth_gbs * 1e9) * 1e3
    compute = 2 * shape.parameters * n / (device.peak_tflops * 1e12) * 1e3
    return launches + max(stream, compute)


def project(steps: Sequence[tuple[int, int, float]], device: Device, shape: Shape) -> float:
    """A run's speedup over plain decoding on ``device``: ``steps`` holds each decoding step's tree nodes (root
    included), tokens produced and host work in ms (as measured here); plain decoding, one t(1) per token.

    >>> dev = Device("flat", 100, 1e6, 2, 0, "a device where a tree costs what one token costs")
    >>> project([(13, 3, 0.0), (13, 1, 0.0)], dev, Shape(1e9, 1))   # 4 tokens in 2 passes of equal cost
    2.0
    """
    tokens = sum(t for _, t, _ in steps)
    method = sum(step_ms(device, shape, n) + host for n, _, host in steps)
    return tokens * step_ms(device, shape, 1) / method if method > 0 else 0.0


def fitted_here(curve: Mapping[int, float], shape: Shape, bandwidth_gbs: float, bytes_per_weight: float,
                name: str = "this machine") -> Device:
    """This machine as the model sees it: its measured read bandwidth, and the fixed cost and throughput that make
    the model meet the measured t(N) (``curve``, ms by N) at N = 1 and at the largest N.

    >>> dev = fitted_here({1: 12.0, 64: 20.0}, Shape(1e9, 10), 200.0, 2)   # 10 ms to stream: 2 ms fixed
    >>> round(dev.launch_us, 1), round(step_ms(dev, Shape(1e9, 10), 64), 6)
    (14.3, 20.0)
    """
    stream = shape.parameters * bytes_per_weight / (bandwidth_gbs * 1e9) * 1e3
    fixed = max(0.0, curve[1] - stream)
    n_max = max(curve)
    busy = curve[n_max] - fixed
    peak = 2 * shape.parameters * n_max / (busy * 1e9) if busy > stream else float("inf")
    return Device(name, bandwidth_gbs, peak, bytes_per_weight, fixed * 1e3 / (shape.layers * KERNELS_PER_LAYER),
                  "measured here: read bandwidth; fixed cost and throughput fitted to the measured t(1) and t(N) "
                  "at the largest N")


def curve_error(curve: Mapping[int, float], device: Device, shape: Shape) -> float:
    """The model's mean relative error against a measured t(N) curve (ms by N): 0.1 is 10%."""
    return mean(abs(step_ms(device, shape, n) / ms - 1) for n, ms in curve.items())


def paper_check() -> dict:
    """The A100 profile against the paper's measured Vicuna-7B figure: the model's speedup for 2.70 tokens per pass
    with the 81-node tree (no host work), and its error against the 2.03x measured.

    >>> check = paper_check()
    >>> check["modelled"], check["measured"], check["error"]
    (2.7, 2.03, 0.33)
    """
    shape, n = PAPER["shape"], PAPER["tree_nodes"]
    device = DEVICES[PAPER["device"]]
    modelled = PAPER["tokens_per_pass"] * step_ms(device, shape, 1) / step_ms(device, shape, n)
    return {"device": device.name, "modelled": round(modelled, 2), "measured": PAPER["speedup"],
            "error": round(modelled / PAPER["speedup"] - 1, 2)}


def projection(steps: Sequence[tuple[int, int, float]], shape: Shape, here: Device | None = None,
               here_curve: Mapping[int, float] | None = None, measured: float | None = None) -> list[dict]:
    """One row per device: ``{device, speedup, model_error, modelled}``. This machine first, with its ``measured``
    speedup and the model's error against its measured t(N); then each profile, modelled (the A100's error is the
    paper check's, the others cannot be checked here: ``None``)."""
    rows = []
    if here is not None and here_curve:
        rows.append({"device": here.name, "speedup": None if measured is None else round(measured, 3),
                     "modelled_speedup": round(project(steps, here, shape), 3),
                     "model_error": round(curve_error(here_curve, here, shape), 3), "modelled": False})
    check = paper_check()
    for name, device in DEVICES.items():
        rows.append({"device": name, "speedup": round(project(steps, device, shape), 3),
                     "model_error": check["error"] if name == check["device"] else None, "modelled": True})
    return rows

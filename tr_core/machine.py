"""What machine this is, in words: the names measurements are cached under and reports print. A leaf: both backends'
rooms and the algorithm read it."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_name() -> str:
    """This machine's CPU, by name (``model name`` of /proc/cpuinfo, else what the platform says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    """The machine a device is, in words: the GPU's name, or the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()

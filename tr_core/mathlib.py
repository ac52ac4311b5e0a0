"""The first call into torch's vector math library, made once on one thread before any other.

torch built with Intel's MKL computes ``cos``, ``sin``, ``exp`` and others of float tensors with MKL's vector math
(VML), in pieces of 2,048 values shared among its threads. On an Intel Xeon with AMX (torch 2.13, MKL 2024.2, 2
threads) the first such call in a process, when its pieces ran on two threads at once, gave the first piece values
up to 1.5e-4 off (later calls: 6e-8) in 11 of 30 fresh processes: ``torch.cos`` of 4,096 floats, nothing else
imported. A Llama model's rotary embedding is such a call (``cos`` of positions x frequencies), so a process's first
prompt of 33 tokens or more could be prefilled with other keys than the same prompt later, and so decode other
tokens; the invariance check's first forward (130 tokens) gave other logits in 3 of 30 processes (docs/speed.md). One
call of one value on this thread alone first (``settle``) did away with it: 0 of 30 processes, in each of several
repro scripts. ``tr_core.models`` makes that call when it is imported, before any model is loaded or run; the same bits
then come out every time.
"""

from __future__ import annotations

import torch

_settled = False


def settle() -> None:
    """Run one vector-math call on this thread alone, once per process (the call on 2 threads then computes every
    value alike; see the module's docstring). Cheap: one value."""
    global _settled
    if not _settled:
        torch.cos(torch.zeros(1))
        _settled = True


settle()

"""The first call into torch's vector math library, made once on one thread before any other.

torch built with Intel's MKL computes ``cos``, ``sin``, ``exp`` and others of float tensors with MKL's vector math
(VML), in pieces of 2,048 values shared among its threads. On an Intel Xeon with AMX (torch 2.13, MKL 2024.2, 2
threads) the first such call in a fresh process, its pieces on two threads at once, often gave other bits than the
same call later: ``torch.cos`` of 4,096 floats, nothing else imported, in 11 of 30 processes. A Llama model's rotary
embedding is such a call (``cos`` of positions x frequencies): on its first call the first piece came out up to
1.5e-4 off (later calls 6e-8), so a process's first prompt of 33 tokens or more could be prefilled with other keys
than the same prompt later, and decode other tokens. The 130-token prefix the invariance check feeds first gave
another cache in 3 of 30 processes (docs/speed.md). One call of one value on this thread alone first (``settle``)
did away with it: 0 of 30 processes in each of these reproductions. ``tr_core.models`` makes that call when it is
imported, before any model is loaded or run.
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

"""Host reads of device data, counted on a CPU: a torch function mode that marks the tensors a run keeps "on the
device" (the model's weights, whatever is made with an explicit ``device=`` or moved with ``.to(device)``, and
everything computed from them) and counts every read of a marked tensor to the host (``tolist``, ``item``, ``int``,
``bool``, ``float``, ``numpy``, ``cpu``). On a GPU each such read waits for the device; here they cost nothing, so
only this count shows them."""

from __future__ import annotations

import traceback
import weakref

import torch
from torch.overrides import TorchFunctionMode

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
FACTORIES = {"zeros", "empty", "full", "ones", "arange", "tensor", "eye", "zeros_like", "empty_like", "full_like",
             "ones_like", "randint", "as_tensor", "new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"}


class DeviceReads(TorchFunctionMode):
    def __init__(self, *on_device: torch.Tensor):
        super().__init__()
        self._marked: dict[int, weakref.ref] = {}
        self.counting = False
        self.reads: list[str] = []  # where each counted read was made
        for t in on_device:
            self.mark(t)

    def mark(self, t: torch.Tensor) -> None:
        self._marked[id(t)] = weakref.ref(t)

    def marked(self, x) -> bool:
        ref = self._marked.get(id(x)) if isinstance(x, torch.Tensor) else None
        return ref is not None and ref() is x

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        inputs = list(args) + list(kwargs.values())
        inputs += [y for x in list(inputs) if isinstance(x, (list, tuple)) for y in x]
        from_device = any(self.marked(x) for x in inputs)
        if name in READS and from_device and self.counting:
            caller = next(f for f in reversed(traceback.extract_stack()[:-1]) if "device_reads" not in f.filename)
            self.reads.append(f"{caller.filename.rsplit('/', 1)[-1]}:{caller.lineno} {name}")
        out = func(*args, **kwargs)
        moved = name == "to" and (any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs)
        if moved and out is args[0] and not from_device:
            out = out.clone()  # as on a GPU: a copy on the device, the host's tensor left as it is
        made_there = (name in FACTORIES and kwargs.get("device") is not None) or moved
        if (from_device and name not in READS) or made_there:
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    self.mark(o)
        return out

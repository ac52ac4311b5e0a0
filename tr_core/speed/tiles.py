"""A weight as native.c's linear layers read it (``WeightTiles``), laid out once when a plan is applied: in tiles
of 32 outputs, input by input (fp32, fp16), in input pairs (bf16) or in AMX tiles. Read by the layouts and by the C
library's own checks, so it sits below both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import pages

TILE = 32  # native.c's tr_linear_f16 and tr_linear_f32: the outputs of one tile


@dataclass(frozen=True)
class WeightTiles:
    """A weight (out, in) as native.c's linear layers read it: fp16 (``tr_linear_f16``) or fp32 (``tr_linear_f32``),
    in tiles of 32 outputs, each tile input by input (the 32 outputs' weights of input 0, then of input 1, ...; zeros
    past ``out``), so the weights are read front to back; bf16 in pairs (``tr_linear_bf16``) or AMX tiles
    (``tr_linear_amx``, ``amx``), as ``weight_tiles`` says."""
    tiles: torch.Tensor  # (ceil(out / 32), in, 32), contiguous (other shapes for bf16: ``weight_tiles``)
    out_features: int
    in_features: int
    amx: bool = False

    @property
    def kernel(self) -> torch.dtype | str:
        """Which of native.c's linear layers reads these tiles (``native.LINEAR``'s key)."""
        return "amx" if self.amx else self.tiles.dtype


def weight_tiles(w: torch.Tensor, dtype: torch.dtype, amx: bool = False) -> WeightTiles:
    """``w`` (out, in) packed for native.c's linear layer of ``dtype``: for bf16 (``tr_linear_bf16``) in tiles of 32
    outputs by input pairs ((ceil(out / 32), ceil(in / 2), 32, 2): each output's weights of inputs 2p and 2p + 1 side
    by side, zeros past ``out`` and ``in``); with ``amx``, bf16 for ``tr_linear_amx``: blocks of 32 outputs, each
    holding for every run k of 32 inputs two AMX B tiles (outputs 0-15, then 16-31 of the block), a tile 16 rows of
    input pairs by 16 outputs ((ceil(out / 32), ceil(in / 32), 2, 16, 16, 2): [b, k, half, p, o, j] is the weight of
    output 32b + 16 half + o, input 32k + 2p + j; zeros past ``out`` and ``in``); else input by input.

    >>> inputs = weight_tiles(torch.arange(33.).expand(40, 33), torch.bfloat16, amx=True).tiles  # w[o, i] = i
    >>> outputs = weight_tiles(torch.arange(40.)[:, None].expand(40, 33), torch.bfloat16, amx=True).tiles  # = o
    >>> tuple(inputs.shape), inputs[0, 0, 1, 3, 0].tolist(), inputs[0, 1, 0, 0, 5].tolist()
    ((2, 2, 2, 16, 16, 2), [6.0, 7.0], [32.0, 0.0])
    >>> outputs[1, 0, 0, 0, 2].tolist(), outputs[0, 0, 1, 0, 3].tolist(), outputs[1, 0, 1, 0, 0].tolist()
    ([34.0, 34.0], [19.0, 19.0], [0.0, 0.0])
    """
    out, inp = w.shape
    if amx:
        runs, blocks = -(-inp // 32), -(-out // TILE)
        padded = torch.zeros(blocks * TILE, runs * 32, dtype=torch.bfloat16)
        padded[:out, :inp] = w
        return WeightTiles(_placed(padded.view(blocks, 2, 16, runs, 16, 2).permute(0, 3, 1, 4, 2, 5)), out, inp,
                           amx=True)
    if dtype == torch.bfloat16:
        pairs = -(-inp // 2)
        padded = torch.zeros(-(-out // TILE) * TILE, 2 * pairs, dtype=dtype)
        padded[:out, :inp] = w
        return WeightTiles(_placed(padded.view(-1, TILE, pairs, 2).transpose(1, 2)), out, inp)
    padded = torch.zeros(-(-out // TILE) * TILE, inp, dtype=dtype)
    fp16 = torch.finfo(torch.float16).max  # as fbgemm's packing does: a weight beyond fp16's range saturates
    padded[:out] = w.clamp(-fp16, fp16) if dtype == torch.float16 else w
    return WeightTiles(_placed(padded.view(-1, TILE, inp).transpose(1, 2)), out, inp)


def _placed(view: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``view`` made by ``pages.empty``: on 2 MB pages where a model's plan is being applied
    (``kernels.apply_plan``) and the system offers them."""
    out = pages.empty(tuple(view.shape), view.dtype)
    out.copy_(view)
    return out

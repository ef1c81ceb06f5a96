"""Column panels of quantisation codes: an fp32 weight that is exactly a GGUF grid, held as that grid.

The store's SmolLM2 was dequantised from a GGUF file: its projections are Q4_1 grids (q4_panels.py),
its embedding and tied LM head a Q8_0 grid (q8_panels.py). Each format's kernel op finds and checks
the grid value by value at load and the matmul expands the codes back to the same fp32 values before
the same FMAs (csrc/code_panels.h): bit-identical results from a fraction of the bytes. This module
picks the format for a weight and reads any of them back.
"""

from __future__ import annotations

import torch

from gpuservd.runner import q4_panels, q8_panels
from gpuservd.runner.panel_arena import PanelArena, switch_on

FORMATS = (q4_panels, q8_panels)  # tried in this order: the fewer bytes first


def pack_exact(w: torch.Tensor, ops, arena: PanelArena | None = None) -> torch.Tensor | None:
    """W [N, K] fp32 as the panels of the first format whose grid it is exactly (and whose switch is on),
    else None. A weight on no grid costs each format's search up to its first group that fails."""
    if w.device.type != "cpu":
        return None
    for fmt in FORMATS:
        if not switch_on(fmt.SWITCH) or not hasattr(ops, fmt.PACK_OP):
            continue
        packed = getattr(ops, fmt.PACK_OP)(w)
        if packed.numel() == 0:
            continue
        if arena is None:
            return packed
        out = arena.empty(tuple(packed.shape), torch.uint8)
        out.copy_(packed)
        return out
    return None


def format_of(packed: torch.Tensor):
    """The format module of a code-panel tensor (by its bytes a group)."""
    for fmt in FORMATS:
        if packed.shape[-1] == fmt.GROUP_BYTES:
            return fmt
    raise ValueError(f"not a code-panel tensor: {tuple(packed.shape)}")


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The dense fp32 W [n, k] code panels hold."""
    return format_of(packed).unpack(packed, n, k)


def rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """W[ids] [len(ids), k] fp32 from code panels (an embedding lookup on a tied weight)."""
    return format_of(packed).rows(packed, ids, k)

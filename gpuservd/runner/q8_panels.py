"""Column panels of 8-bit codes: an fp32 weight that is exactly an 8-bit grid, held as that grid.

A weight dequantised from GGUF's Q8_0 (the store's SmolLM2 embedding, tied to its LM head: `gguf`
computes d * q in fp32, q in -127..127, d fp16 per 32 input positions of a row) is, value for value, such
a grid. Held as its codes it takes 8.5 bits a weight instead of 32 (the scales included), and
csrc/q8_panels.cpp expands them back to the same fp32 values before the same FMAs (q * d is exact in
fp32), so a matmul's results are bit-identical to the fp32 panels'. The grid is found and checked value
by value at load (pack_panels_q8, in the same file); one value off and the weight keeps fp32 (or bf16)
panels.
It matters where a step is a pass over the weights: SmolLM2's 49152 x 576 LM head is 113 MB in fp32
panels, 30 MB in these, and a decode step of a few rows streams all of it.

`GPUSERV_PANELS_Q8=0` keeps such weights in fp32 panels (the A/B reference).

Layout [P, K / 32, 544] uint8, per panel p (16 output columns) and group g of 32 input positions: the
16 columns' fp16 scales (32 bytes), then 32 k steps of 16 bytes, column j's signed code in byte j.
"""

from __future__ import annotations

import torch

SWITCH = "GPUSERV_PANELS_Q8"
PACK_OP = "pack_panels_q8"  # the kernels' op that finds and checks the grid (csrc/q8_panels.cpp)
GROUP = 32  # input positions per scale (GGUF's block)
GROUP_BYTES = 32 + GROUP * 16
PANEL = 16


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The dense fp32 W [n, k] 8-bit panels hold."""
    p, groups, _ = packed.shape
    d = packed[..., :32].contiguous().view(torch.float16).float()[:, :, None, :]  # [p, g, 1, column]
    q = packed[..., 32:].contiguous().view(torch.int8).reshape(p, groups, GROUP, PANEL).float()
    return (q * d).permute(0, 3, 1, 2).reshape(p * PANEL, groups * GROUP)[:n, :k]


def rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """W[ids] [len(ids), k] fp32 (an embedding lookup on a tied weight held in 8-bit panels): only the
    panels holding those rows are read."""
    blocks = packed.index_select(0, ids // PANEL)  # [n, g, 544]
    j = (ids % PANEL)[:, None, None]
    scales = blocks[..., :32].contiguous().view(torch.float16).float()  # [n, g, 16]
    d = scales.gather(2, j.expand(-1, scales.shape[1], 1))  # [n, g, 1]
    codes = blocks[..., 32:].contiguous().view(torch.int8).reshape(len(ids), -1, GROUP, PANEL)
    q = codes.gather(3, j[..., None].expand(-1, blocks.shape[1], GROUP, 1)).squeeze(3).float()  # [n, g, 32]
    return (q * d).reshape(len(ids), -1)[:, :k]

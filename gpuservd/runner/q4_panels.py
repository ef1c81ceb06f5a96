"""Column panels of 4-bit codes: an fp32 weight that is exactly a 4-bit grid, held as that grid.

A weight dequantised from GGUF's Q4_1 (the store's SmolLM2 projections: `gguf` computes d * q + m in
fp32, q in 0..15, d and m fp16 per 32 input positions of a row) is, value for value, such a grid. Held
as its codes it takes 5 bits a weight instead of 32 (the scales and offsets included), and
csrc/q4_panels.cpp expands them back to the same fp32 values before the same FMAs, so a matmul's results
are bit-identical to the fp32 panels'. The grid is found and checked value by value at load
(pack_panels_q4, in the same file; code_panels.py tries each format); one value off and the weight keeps
its fp32 (or bf16) panels.
It matters where a step is a pass over the weights, a decode step of a few rows: fp32 panels read 538 MB
a step for SmolLM2, these 96 MB (with its tied LM head, an 8-bit grid held in q8_panels.py's 8-bit panels).

`GPUSERV_PANELS_Q4=0` keeps such weights in fp32 panels (the A/B reference).

Layout [P, K / 32, 320] uint8, per panel p (16 output columns) and group g of 32 input positions: the
16 columns' fp16 scales (32 bytes), their fp16 offsets (32 bytes), then 32 k steps of 8 bytes, column j's
code in byte j % 8 (low nibble for j < 8, high for j >= 8).
"""

from __future__ import annotations

import torch

SWITCH = "GPUSERV_PANELS_Q4"
PACK_OP = "pack_panels_q4"  # the kernels' op that finds and checks the grid (csrc/q4_panels.cpp)
GROUP = 32  # input positions per scale and offset (GGUF's block)
GROUP_BYTES = 64 + GROUP * 8
PANEL = 16


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The dense fp32 W [n, k] 4-bit panels hold."""
    p, groups, _ = packed.shape
    d = packed[..., :32].contiguous().view(torch.float16).float()[:, :, None, :]
    m = packed[..., 32:64].contiguous().view(torch.float16).float()[:, :, None, :]
    nib = packed[..., 64:].reshape(p, groups, GROUP, 8)
    q = torch.cat([nib & 15, nib >> 4], dim=3).float()  # [p, g, k, column]
    w = q * d + m
    return w.permute(0, 3, 1, 2).reshape(p * PANEL, groups * GROUP)[:n, :k]


def rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """W[ids] [len(ids), k] fp32 (an embedding lookup on a tied weight held in 4-bit panels): only the
    panels holding those rows are read."""
    blocks = packed.index_select(0, ids // PANEL)  # [n, g, 320]
    j = (ids % PANEL)[:, None, None]
    halves = blocks[..., :64].contiguous().view(torch.float16).float()  # [n, g, 32]: scales, then offsets
    d, m = halves.gather(2, j.expand(-1, halves.shape[1], 1)), halves.gather(2, (j + 16).expand(-1, halves.shape[1], 1))
    nib = blocks[..., 64:].reshape(len(ids), -1, GROUP, 8).gather(3, (j % 8)[..., None].expand(-1, blocks.shape[1], GROUP, 1))
    q = torch.where(j[..., None] < 8, nib & 15, nib >> 4).squeeze(3).float()  # [n, g, 32]
    return (q * d + m).reshape(len(ids), -1)[:, :k]

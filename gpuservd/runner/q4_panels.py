"""Column panels of 4-bit codes: an fp32 weight that is exactly a 4-bit grid, held as that grid.

A weight dequantised from GGUF's Q4_1 (the store's SmolLM2 projections: `gguf` computes d * q + m in
fp32, q in 0..15, d and m fp16 per 32 input positions of a row) is, value for value, such a grid. Held
as its codes it takes 5 bits a weight instead of 32 (the scales and offsets included), and
csrc/packed_gemm_f32.cpp expands each K block back to the same fp32 values before the same FMAs, so a
matmul's results are bit-identical to the fp32 panels'. The grid is found and checked value by value at
load (`grid`, and pack_panels_q4 in csrc/q4_panels.cpp); one value off and the weight keeps its fp32 (or bf16) panels. It matters where a step is
a pass over the weights: the decode tail of a few rows, where fp32 panels read 538 MB a step for
SmolLM2 and these 108 MB (its tied LM head, an 8-bit grid, stays fp32).

`GPUSERV_PANELS_Q4=0` keeps such weights in fp32 panels (the A/B reference).

Layout [P, K / 32, 320] uint8, per panel p (16 output columns) and group g of 32 input positions: the
16 columns' fp16 scales (32 bytes), their fp16 offsets (32 bytes), then 32 k steps of 8 bytes, column j's
code in byte j % 8 (low nibble for j < 8, high for j >= 8).
"""

from __future__ import annotations

import torch

from gpuservd.runner.panel_arena import PanelArena, switch_on

Q4_SWITCH = "GPUSERV_PANELS_Q4"
GROUP = 32  # input positions per scale and offset (GGUF's block)
GROUP_BYTES = 64 + GROUP * 8
PANEL = 16
_STEPS = (0, 1, -1, 2, -2)  # the scale as rounded, then fp16 steps either side, for the groups it misses


def _fits(g: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes q of groups g [.., 32] on the grid (d, m) [..] (fp16 values in fp32), and which groups it
    reproduces bit for bit (q * d is exact in fp32, so q * d + m rounds once, as d * q + m did)."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = ((g - m[..., None]) / safe[..., None]).round_().clamp_(0, 15)
    q = torch.where(d[..., None] == 0, torch.zeros_like(q), q)
    back = q * d[..., None] + m[..., None]
    ok = (back.view(torch.int32) == g.view(torch.int32)).all(dim=-1)
    return q, ok


def grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(codes uint8 [N, K/32, 32], scales fp16 [N, K/32], offsets fp16 [N, K/32]) when every value of
    W [N, K] fp32 is exactly its group's code * scale + offset, else None."""
    n, k = w.shape
    if w.dtype != torch.float32 or k % GROUP or n == 0:
        return None
    g = w.detach().reshape(n, k // GROUP, GROUP)
    lo = g.amin(dim=2)  # the offset: the group's least value has code 0
    m16 = lo.half()
    if not torch.equal(m16.float().view(torch.int32), lo.view(torch.int32)):
        return None
    head = g[: max(1, 4096 // (k // GROUP))]  # ~4096 groups first: most weights are on no such grid
    head_d = ((head.amax(dim=2) - head.amin(dim=2)) / 15).half().float()
    if _fits(head, head_d, head.amin(dim=2))[1].float().mean() < 0.9:
        return None
    span = g.amax(dim=2) - lo
    d16 = (span / 15).half()
    q, ok = _fits(g, d16.float(), lo)  # the whole weight at once; then only the groups it missed
    codes = q.to(torch.uint8)
    todo = ~ok
    # Q4_1's scale is span / 15 (the greatest value has code 15), rounded to fp16; a group whose greatest
    # code is less is tried on span / 14, ... (only the groups still missing: a pass over them each).
    for top in range(15, 0, -1):
        for step in _STEPS:
            idx = todo.nonzero(as_tuple=True)
            if not idx[0].numel():
                return codes, d16, m16
            cand = (span[idx] / top).half()
            if step:
                cand = (cand.view(torch.int16) + step).view(torch.float16)
                keep = torch.isfinite(cand) & (cand >= 0)
                idx, cand = tuple(i[keep] for i in idx), cand[keep]
            q, ok = _fits(g[idx], cand.float(), lo[idx])
            hit = tuple(i[ok] for i in idx)
            codes[hit] = q[ok].to(torch.uint8)
            d16[hit] = cand[ok]
            todo[hit] = False
    return None if todo.any() else (codes, d16, m16)


def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
         arena: PanelArena | None = None) -> torch.Tensor:
    """The grid as 4-bit panels [ceil(N/16), K/32, 320] (the layout above); padded columns are 0 * 0 + 0."""
    n, groups, _ = codes.shape
    p = -(-n // PANEL)
    if p * PANEL != n:
        pad = p * PANEL - n
        codes = torch.nn.functional.pad(codes, (0, 0, 0, 0, 0, pad))
        scales = torch.nn.functional.pad(scales, (0, 0, 0, pad))
        offsets = torch.nn.functional.pad(offsets, (0, 0, 0, pad))
    q = codes.view(p, PANEL, groups, GROUP).permute(0, 2, 3, 1)  # [p, g, k, column]
    nibbles = (q[..., :8] | (q[..., 8:] << 4)).reshape(p, groups, GROUP * 8)

    def halves(t: torch.Tensor) -> torch.Tensor:
        return t.view(p, PANEL, groups).permute(0, 2, 1).contiguous().view(torch.uint8)

    out = arena.empty((p, groups, GROUP_BYTES), torch.uint8) if arena is not None \
        else torch.empty((p, groups, GROUP_BYTES), dtype=torch.uint8)
    out[..., :32] = halves(scales)
    out[..., 32:64] = halves(offsets)
    out[..., 64:] = nibbles
    return out


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


def pack_exact(w: torch.Tensor, ops, arena: PanelArena | None = None) -> torch.Tensor | None:
    """W [N, K] fp32 as 4-bit panels when it is exactly a 4-bit grid (found and checked by the kernels'
    pack_panels_q4, the same search as `grid` in C++) and the switch is on, else None."""
    if not switch_on(Q4_SWITCH) or w.device.type != "cpu" or not hasattr(ops, "pack_panels_q4"):
        return None
    packed = ops.pack_panels_q4(w)
    if packed.numel() == 0:
        return None
    if arena is None:
        return packed
    out = arena.empty(tuple(packed.shape), torch.uint8)
    out.copy_(packed)
    return out

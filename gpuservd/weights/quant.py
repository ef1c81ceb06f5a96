"""Group-wise INT8 weights: what the host and disk tiers may hold, to move fewer bytes.

A matrix W [out, in] is stored as int8 q with, per group of GROUP_SIZE input
columns of each row, an fp16 scale and an fp16 offset (`minimum`):
W ~= (q + 128) * scale + minimum. It is expanded to the compute dtype on the
device (runner/qtensor.py), the same code on the CPU and on a GPU.

Each group is put on the best (least squared error) of three grids, all in
that one layout:
- asymmetric: the 256 levels spread over the group's own [min, max];
- symmetric: 255 levels over [-max|w|, max|w|] with zero exact, written as
  minimum = -128 * scale so the expansion is q * scale;
- 4-bit: 16 levels over [min, max] (q + 128 in 0..15).
Weights that came from a lower-precision source keep their values: an 8-bit
grid of 32 columns (GGUF Q8_0, SmolLM2's embedding) is the symmetric grid, a
4-bit grid with an offset (GGUF Q4_1, SmolLM2's projections) the 4-bit one,
exactly (up to fp32 rounding), so the expansion casts to the same bf16 values
as the original does. Other weights take the asymmetric grid nearly always;
the kept grid is never worse than it.

Measured on SmolLM2 (fp32 reference, 8 chat prompts + 32 greedy tokens, 558
positions; README): asymmetric groups of 64 kept 97.1% of next tokens teacher-
forced and 4 of 8 replies identical; asymmetric groups of 32 99.3% and 6 of 8;
the best of the first two grids 99.8% and 7 of 8 in fp32, but 97.1% and 3 of 8
in bf16 against bf16 (a Q4_1 weight a little off its value often casts to a
neighbouring bf16 value; bf16 itself against fp32: 98.6%, 3 of 8); all three
grids 100% and 8 of 8, in fp32 and in bf16. The
scale and offset cost 4 bytes per 32 weights: the file is 56% of bf16's bytes,
28% of fp32's.
"""

from __future__ import annotations

import torch

from gpuservd.runner.qtensor import QTensor

GROUP_SIZE = 32  # input columns per scale: GGUF's block width, and it divides every hidden/intermediate size
SCALE_DTYPE = torch.float16
_FP16_TINY = 2.0 ** -24  # the smallest fp16 subnormal: a group of zeros keeps a scale that is not 0
_FP16_MAX = torch.finfo(SCALE_DTYPE).max


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """W in fp32 as [rows, groups, group_size]; a short last group is padded with a real weight of its row
    (padding must not widen the group's range)."""
    rows, cols = w.shape
    groups = -(-cols // group_size)
    wf = torch.empty((rows, groups * group_size), dtype=torch.float32)
    wf[:, :cols] = w.to(torch.float32)
    if groups * group_size != cols:
        wf[:, cols:] = wf[:, cols - 1:cols]
    return wf.view(rows, groups, group_size)


def _asymmetric(wf: torch.Tensor, steps: int = 255) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, minimum) over each group's [min, max] in `steps` steps (255: every level; 15: a 4-bit grid in
    the same layout). The scale and minimum are rounded to fp16 first and q is computed against the rounded
    values: the expansion uses them."""
    lo = wf.amin(dim=2).to(SCALE_DTYPE)
    scale = ((wf.amax(dim=2) - lo.float()) / steps).clamp(min=_FP16_TINY, max=_FP16_MAX).to(SCALE_DTYPE)
    q = torch.round((wf - lo.float()[:, :, None]) / scale.float()[:, :, None]).clamp_(0, steps) - 128
    return q, scale, lo


def _symmetric(wf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, minimum = -128 * scale) over [-max|w|, max|w|]: q * scale, zero on the grid."""
    # 128 * scale must stay a finite fp16: such a group (|w| > 2^16 / 2) takes the asymmetric grid
    scale = (wf.abs().amax(dim=2) / 127.0).clamp(min=_FP16_TINY, max=_FP16_MAX / 128).to(SCALE_DTYPE)
    q = torch.round(wf / scale.float()[:, :, None]).clamp_(-127, 127)
    return q, scale, scale * -128


def quantize_int8(w: torch.Tensor, group_size: int = GROUP_SIZE) -> QTensor:
    """Group-wise INT8 of a 2-D weight (the last group may be shorter), each group on the grid, of GRIDS, whose
    expansion has the least squared error."""
    if w.dim() != 2:
        raise ValueError(f"int8 quantization takes a matrix, got shape {tuple(w.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    rows, cols = w.shape
    wf = _grouped(w, group_size)
    real = (torch.arange(wf.shape[1] * group_size) < cols).view(1, -1, group_size)  # padding is no weight
    best = best_err = None
    for grid in GRIDS:  # the first grid wins ties
        q, s, lo = grid(wf)
        err = ((q + 128) * s.float()[:, :, None] + lo.float()[:, :, None] - wf).square().mul_(real).sum(dim=2)
        if best is None:
            best, best_err = [q, s, lo], err
            continue
        better = err < best_err
        best = [torch.where(better[:, :, None], q, best[0]), torch.where(better, s, best[1]),
                torch.where(better, lo, best[2])]
        best_err = torch.minimum(err, best_err)
    q, s, lo = best
    q = q.to(torch.int8).view(rows, -1)[:, :cols].contiguous()
    return QTensor(q, s.contiguous(), group_size, lo.contiguous())


# The candidate grids, all in one layout: every level over [min, max]; 255 levels over [-max|w|, max|w|];
# a 4-bit grid over [min, max] (16 levels: a step of an fp16 scale that a 4-bit source's weights are on,
# where the 255-level grid's step range/255 is a third of an fp16 rounding away from theirs).
GRIDS = (_asymmetric, _symmetric, lambda wf: _asymmetric(wf, 15))


def quantizable(name: str, t: torch.Tensor) -> bool:
    """Matrices are quantized (projections, embeddings, lm_head); vectors (norms, biases) stay exact."""
    return t.dim() == 2 and t.is_floating_point()

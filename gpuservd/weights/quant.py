"""Group-wise INT8 weights: what the host and disk tiers may hold, to move fewer bytes.

A matrix W [out, in] is stored as int8 q with, per group of GROUP_SIZE input
columns of each row, an fp16 scale and an fp16 offset (`minimum`):
W ~= (q + 128) * scale + minimum. It is expanded to the compute dtype on the
device (runner/qtensor.py), the same code on the CPU and on a GPU.

Each group is put on the better (least squared error) of two grids, both in
that one layout:
- asymmetric: the 256 levels spread over the group's own [min, max];
- symmetric: 255 levels over [-max|w|, max|w|] with zero exact, written as
  minimum = -128 * scale so the expansion is q * scale.
A group whose weights already lie on an 8-bit grid of 32 columns (weights
dequantized from GGUF Q8_0, as SmolLM2's embedding is) is kept exactly by the
symmetric one; a 4-bit grid with an offset (Q4_1, SmolLM2's projections) falls
on every 17th level of the asymmetric one, off only by the fp16 rounding of
the scale (under 2^-11 of the group's range). For other weights the kept grid
is never worse than the asymmetric one alone.

Measured on SmolLM2 (fp32 reference, 8 chat prompts + 32 greedy tokens, 558
positions; README): asymmetric groups of 64 kept 97.1% of next tokens teacher-
forced and 4 of 8 replies identical; asymmetric groups of 32 99.3% and 6 of 8;
this scheme 99.8% and 7 of 8 (bf16 itself against fp32: 98.6%, 3 of 8). The
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


def _asymmetric(wf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, minimum) over each group's [min, max]. The scale and minimum are rounded to fp16 first and q
    is computed against the rounded values: the expansion uses them."""
    lo = wf.amin(dim=2).to(SCALE_DTYPE)
    scale = ((wf.amax(dim=2) - lo.float()) / 255.0).clamp(min=_FP16_TINY, max=_FP16_MAX).to(SCALE_DTYPE)
    q = torch.round((wf - lo.float()[:, :, None]) / scale.float()[:, :, None]).clamp_(0, 255) - 128
    return q, scale, lo


def _symmetric(wf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, minimum = -128 * scale) over [-max|w|, max|w|]: q * scale, zero on the grid."""
    # 128 * scale must stay a finite fp16: such a group (|w| > 2^16 / 2) takes the asymmetric grid
    scale = (wf.abs().amax(dim=2) / 127.0).clamp(min=_FP16_TINY, max=_FP16_MAX / 128).to(SCALE_DTYPE)
    q = torch.round(wf / scale.float()[:, :, None]).clamp_(-127, 127)
    return q, scale, scale * -128


def quantize_int8(w: torch.Tensor, group_size: int = GROUP_SIZE) -> QTensor:
    """Group-wise INT8 of a 2-D weight (the last group may be shorter), each group on the better of the
    asymmetric and the symmetric grid (least squared error of the expanded weights)."""
    if w.dim() != 2:
        raise ValueError(f"int8 quantization takes a matrix, got shape {tuple(w.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    rows, cols = w.shape
    wf = _grouped(w, group_size)
    grids = [_asymmetric(wf), _symmetric(wf)]
    real = (torch.arange(wf.shape[1] * group_size) < cols).view(1, -1, group_size)  # padding is no weight
    errors = [((q + 128) * s.float()[:, :, None] + lo.float()[:, :, None] - wf).square().mul_(real).sum(dim=2)
              for q, s, lo in grids]
    sym = errors[1] < errors[0]  # [rows, groups]: ties keep the asymmetric grid
    (qa, sa, la), (qs, ss, ls) = grids
    q = torch.where(sym[:, :, None], qs, qa).to(torch.int8).view(rows, -1)[:, :cols].contiguous()
    return QTensor(q, torch.where(sym, ss, sa).contiguous(), group_size, torch.where(sym, ls, la).contiguous())


def quantizable(name: str, t: torch.Tensor) -> bool:
    """Matrices are quantized (projections, embeddings, lm_head); vectors (norms, biases) stay exact."""
    return t.dim() == 2 and t.is_floating_point()

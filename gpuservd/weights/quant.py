"""Group-wise symmetric INT8 weights: what the host and disk tiers may hold, to move fewer bytes.

A matrix W [out, in] is stored as q = round(W / s) in int8 with one fp16 scale
s = max|W[row, group]| / 127 per group of GROUP_SIZE input columns of each row;
it is expanded to the compute dtype on the device (q * s).

Why groups: one scale per row lets the row's largest weight set the step for all
of its hundreds of columns, and the small weights round to a few levels. On
SmolLM2 per-row INT8 kept 70% of greedy tokens (fp32, CPU); with a scale per 64
columns the error of each weight is bounded by its neighbourhood's largest. The
scales cost 2 bytes per 64 weights (3%): the file stays about half of bf16's
bytes, a quarter of fp32's. fp16 rather than bf16 scales: a scale is a positive
number in fp16's range, and fp16 keeps 3 more mantissa bits of it.
"""

from __future__ import annotations

import torch

from gpuservd.runner.qtensor import QTensor

GROUP_SIZE = 64  # input columns per scale (divides every hidden and intermediate size seen so far)
SCALE_DTYPE = torch.float16
_FP16_TINY = 2.0 ** -24  # the smallest fp16 subnormal: a group of zeros keeps a scale that is not 0


def quantize_int8(w: torch.Tensor, group_size: int = GROUP_SIZE) -> QTensor:
    """Symmetric group-wise quantization of a 2-D weight (the last group may be shorter)."""
    if w.dim() != 2:
        raise ValueError(f"int8 quantization takes a matrix, got shape {tuple(w.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    rows, cols = w.shape
    groups = -(-cols // group_size)
    wf = torch.zeros((rows, groups * group_size), dtype=torch.float32)
    wf[:, :cols] = w.to(torch.float32)
    wf = wf.view(rows, groups, group_size)
    # The scale is rounded to fp16 first and q computed against the rounded scale: the expansion uses it.
    scale = (wf.abs().amax(dim=2) / 127.0).clamp(min=_FP16_TINY, max=torch.finfo(SCALE_DTYPE).max)
    scale = scale.to(SCALE_DTYPE)
    q = torch.round(wf / scale.to(torch.float32)[:, :, None]).clamp_(-127, 127).to(torch.int8)
    return QTensor(q.view(rows, groups * group_size)[:, :cols].contiguous(), scale.contiguous(), group_size)


def quantizable(name: str, t: torch.Tensor) -> bool:
    """Matrices are quantized (projections, embeddings, lm_head); vectors (norms, biases) stay exact."""
    return t.dim() == 2 and t.is_floating_point()

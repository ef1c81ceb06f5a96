"""An INT8 matrix as a weight source may hand it to the loader (runner/load.py's Upload).

The host and disk tiers may hold weights as INT8 (weights/quant.py makes them); the
loader expands them to the compute dtype on the device, so only about half of bf16's
bytes (a quarter of fp32's) cross the host -> device link. The type lives here, below
the weight tiers, because the runner reads it and the runner never imports the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QTensor:
    """An int8 matrix with, per group of `group_size` input columns of each row, a scale and an offset:
    W[r, c] ~= (q[r, c] + 128) * scale[r, g] + minimum[r, g], g = c // group_size (weights/quant.py writes
    a symmetric group as minimum = -128 * scale); without a minimum W[r, c] ~= q[r, c] * scale[r, g]."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float16 [out, ceil(in / group_size)]
    group_size: int
    minimum: torch.Tensor | None = None  # float16 [out, groups]: each group's offset (its grid's lowest level)

    @property
    def nbytes(self) -> int:
        parts = (self.q, self.scale) if self.minimum is None else (self.q, self.scale, self.minimum)
        return sum(t.numel() * t.element_size() for t in parts)

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """W in `dtype` (into `out` [out, in] when given), on q's device: one pass, computed in fp32 and
        rounded once. The same code runs on the CPU (the device tier is RAM) and on a GPU after the int8
        bytes were copied there."""
        rows, cols = self.q.shape
        g, groups = self.group_size, self.scale.shape[1]
        scale = self.scale.to(torch.float32)[:, :, None]  # [out, groups, 1]: small, so fp32 math is free
        if out is None:
            out = torch.empty((rows, cols), dtype=dtype, device=self.q.device)
        q = self.q
        if groups * g != cols:  # a last group shorter than group_size: pad, expand, cut
            q = torch.zeros((rows, groups * g), dtype=torch.int8, device=self.q.device)
            q[:, :cols] = self.q
        q = q.view(rows, groups, g)
        target = out.view(rows, groups, g) if groups * g == cols else \
            torch.empty((rows, groups, g), dtype=dtype, device=self.q.device)
        if self.minimum is None:
            torch.mul(q, scale, out=target)
        else:
            bias = self.minimum.to(torch.float32)[:, :, None] + 128.0 * scale
            torch.addcmul(bias, q, scale, out=target)
        if groups * g != cols:
            out.copy_(target.view(rows, groups * g)[:, :cols])
        return out

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
    """An int8 matrix with one scale per group of `group_size` input columns of each row:
    W[r, c] ~= q[r, c] * scale[r, c // group_size]."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float16 [out, ceil(in / group_size)]
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """q * s in `dtype` (into `out` [out, in] when given), on q's device: one pass, computed in fp32 and
        rounded once. The same code runs on the CPU (the device tier is RAM) and on a GPU after the int8
        bytes were copied there."""
        rows, cols = self.q.shape
        g, groups = self.group_size, self.scale.shape[1]
        scale = self.scale.to(torch.float32)[:, :, None]  # [out, groups, 1]: small, so fp32 math is free
        if out is None:
            out = torch.empty((rows, cols), dtype=dtype, device=self.q.device)
        if groups * g == cols:
            torch.mul(self.q.view(rows, groups, g), scale, out=out.view(rows, groups, g))
            return out
        # a last group shorter than group_size (in % group_size != 0): pad, expand, cut
        padded = torch.zeros((rows, groups * g), dtype=torch.int8, device=self.q.device)
        padded[:, :cols] = self.q
        out.copy_((padded.view(rows, groups, g) * scale).view(rows, groups * g)[:, :cols])
        return out

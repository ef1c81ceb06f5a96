"""An INT8 matrix as a weight source may hand it to the loader (runner/load.py's Upload).

The host and disk tiers may hold weights as INT8 (weights/quant.py makes them); the
loader expands them to the compute dtype on the device, so only a quarter of fp32's
bytes cross the host -> device link. The type lives here, below the weight tiers,
because the runner reads it and the runner never imports the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QTensor:
    """An int8 matrix with a per-row scale: W ~= q * scale[:, None]."""

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q * s in `dtype`: one pass, computed in fp32 and rounded once (int8 -> fp32 -> product -> cast
        would take three passes, 1.6x the time for a 2048 x 11264 matrix on a CPU, for the same result)."""
        out = torch.empty(self.q.shape, dtype=dtype, device=self.q.device)
        return torch.mul(self.q, self.scale[:, None], out=out)

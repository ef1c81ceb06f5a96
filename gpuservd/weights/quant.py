"""Per-channel symmetric INT8 weights: what the host and disk tiers may hold, to move fewer bytes.

A matrix W [out, in] is stored as q = round(W / s) in int8 with one fp32 scale
s = max|W[row]| / 127 per output row; it is expanded to the compute dtype on
the device (q * s). A quarter of fp32's bytes cross the host -> device link.
"""

from __future__ import annotations

import torch

from gpuservd.runner.qtensor import QTensor


def quantize_int8(w: torch.Tensor) -> QTensor:
    """Symmetric per-row quantization of a 2-D weight."""
    if w.dim() != 2:
        raise ValueError(f"int8 quantization takes a matrix, got shape {tuple(w.shape)}")
    wf = w.to(torch.float32)
    scale = wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return QTensor(q.contiguous(), scale.contiguous())


def quantizable(name: str, t: torch.Tensor) -> bool:
    """Matrices are quantized (projections, embeddings, lm_head); vectors (norms, biases) stay exact."""
    return t.dim() == 2 and t.is_floating_point()

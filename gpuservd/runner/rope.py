"""Rotary position embeddings, as tables indexed by absolute position.

The tables are computed once in fp32 exactly as transformers does (inv_freq x
position, then cos/sin), so our logits match `LlamaForCausalLM` bit for bit in
fp32. Supported scalings: default, linear, llama3 (Llama 3.1+). Dynamic NTK is
refused by model_config: it changes with the batch's longest sequence, which a
paged server cannot reproduce per request.
"""

from __future__ import annotations

import math

import torch

from gpuservd.runner.model_config import ModelArch


def inv_frequencies(arch: ModelArch) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with the model's rope scaling applied."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RopeTables:
    """cos/sin for every position up to max_len: [max_len, head_dim] each, in the compute dtype."""

    def __init__(self, arch: ModelArch, max_len: int, dtype: torch.dtype, device: torch.device):
        inv_freq = inv_frequencies(arch)
        pos = torch.arange(max_len, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_len, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for positions [T]; computed once per forward, used by every layer."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (rotate-half form, as in HF); q and k heads go through together."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

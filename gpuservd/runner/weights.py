"""Model weights in the runner's layout, loaded layer by layer from safetensors.

q/k/v are fused into one matrix and gate/up into another, so a layer is 4
matmuls instead of 7: fewer, larger GEMMs keep the CPU (and the GPU) closer to
its memory-bandwidth floor at small batch. Layers are separate objects so that
a layer can be loaded, dropped or replaced on its own (layered loading, M5).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from gpuservd.errors import StoreCorrupt
from gpuservd.runner.model_config import ModelArch


@dataclass
class LayerWeights:
    """One decoder layer; shapes in comments (D = hidden, I = intermediate)."""

    input_norm: torch.Tensor  # [D]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, D]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim] (Qwen2)
    o_proj: torch.Tensor  # [D, heads * head_dim]
    post_norm: torch.Tensor  # [D]
    gate_up: torch.Tensor  # [2 * I, D]
    down: torch.Tensor  # [D, I]

    def nbytes(self) -> int:
        ts = [self.input_norm, self.qkv, self.o_proj, self.post_norm, self.gate_up, self.down]
        if self.qkv_bias is not None:
            ts.append(self.qkv_bias)
        return sum(t.numel() * t.element_size() for t in ts)


@dataclass
class ModelWeights:
    """Everything outside the layers, plus the layers."""

    embed: torch.Tensor  # [V, D]
    final_norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D]; the same tensor as embed when tied
    layers: list[LayerWeights]

    def nbytes(self) -> int:
        extra = 0 if self.lm_head is self.embed else self.lm_head.numel() * self.lm_head.element_size()
        emb = self.embed.numel() * self.embed.element_size()
        return emb + extra + self.final_norm.numel() * self.final_norm.element_size() + sum(
            lw.nbytes() for lw in self.layers
        )


class SafetensorsReader:
    """Finds each tensor name in a model directory's shards and reads it on demand."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise StoreCorrupt(f"{index}: unreadable shard index ({exc})") from None
            shards = sorted(set(weight_map.values()))
        else:
            shards = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
            if not shards:
                raise StoreCorrupt(f"{self.model_dir}: no *.safetensors weight file")
        self._handles = {}
        self.name_to_shard: dict[str, str] = {}
        for shard in shards:
            path = self.model_dir / shard
            if not path.exists():
                raise StoreCorrupt(f"{path}: weight shard missing")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise StoreCorrupt(f"{path}: unreadable safetensors file ({exc})") from None
            self._handles[shard] = handle
            for name in handle.keys():
                self.name_to_shard[name] = shard

    def has(self, name: str) -> bool:
        return name in self.name_to_shard

    def get(self, name: str) -> torch.Tensor:
        shard = self.name_to_shard.get(name)
        if shard is None:
            raise StoreCorrupt(f"{self.model_dir}: tensor {name!r} is in no weight file")
        return self._handles[shard].get_tensor(name)


def _cast(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).contiguous()


def load_layer(reader: SafetensorsReader, arch: ModelArch, i: int, dtype, device) -> LayerWeights:
    """Read and fuse one decoder layer."""
    p = f"model.layers.{i}."
    q, k, v = (reader.get(p + f"self_attn.{n}_proj.weight") for n in "qkv")
    bias = None
    if arch.qkv_bias:
        bias = _cast(torch.cat([reader.get(p + f"self_attn.{n}_proj.bias") for n in "qkv"]), dtype, device)
    return LayerWeights(
        input_norm=_cast(reader.get(p + "input_layernorm.weight"), dtype, device),
        qkv=_cast(torch.cat([q, k, v], dim=0), dtype, device),
        qkv_bias=bias,
        o_proj=_cast(reader.get(p + "self_attn.o_proj.weight"), dtype, device),
        post_norm=_cast(reader.get(p + "post_attention_layernorm.weight"), dtype, device),
        gate_up=_cast(torch.cat([reader.get(p + "mlp.gate_proj.weight"), reader.get(p + "mlp.up_proj.weight")]), dtype, device),
        down=_cast(reader.get(p + "mlp.down_proj.weight"), dtype, device),
    )


def load_weights(model_dir: Path, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> ModelWeights:
    """Load a whole model (all layers) into the runner's layout."""
    reader = SafetensorsReader(model_dir)
    embed = _cast(reader.get("model.embed_tokens.weight"), dtype, device)
    if reader.has("lm_head.weight") and not arch.tie_word_embeddings:
        lm_head = _cast(reader.get("lm_head.weight"), dtype, device)
    else:
        lm_head = embed
    layers = [load_layer(reader, arch, i, dtype, device) for i in range(arch.num_layers)]
    return ModelWeights(embed, _cast(reader.get("model.norm.weight"), dtype, device), lm_head, layers)

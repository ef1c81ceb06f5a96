"""A model's weights in the runner's layout: the layers and what lies outside them.

q/k/v are fused into one matrix and gate/up into another, so a layer is 4
matmuls instead of 7: fewer, larger GEMMs keep the CPU (and the GPU) closer to
its memory-bandwidth floor at small batch. Layers are separate objects so that
a layer can be loaded, dropped or replaced on its own (layered loading: the
first layers serve while the rest stream in). runner/load.py fills them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from gpuservd.errors import StoreCorrupt
from gpuservd.runner.linear import Linear


@dataclass
class LayerWeights:
    """One decoder layer; shapes in comments (D = hidden, I = intermediate)."""

    input_norm: torch.Tensor  # [D]
    qkv: Linear  # D -> (heads + 2 * kv_heads) * head_dim, with a bias on Qwen2
    o_proj: Linear  # heads * head_dim -> D
    post_norm: torch.Tensor  # [D]
    gate_up: Linear  # D -> 2 * I
    down: Linear  # I -> D

    def nbytes(self) -> int:
        norms = sum(t.numel() * t.element_size() for t in (self.input_norm, self.post_norm))
        return norms + sum(lin.nbytes for lin in (self.qkv, self.o_proj, self.gate_up, self.down))


class LayerGate:
    """Per-layer readiness of a layered load: the runner waits on layer i before using it."""

    def __init__(self, num_layers: int):
        self._ready = [threading.Event() for _ in range(num_layers)]
        self._loaded = [False] * num_layers
        self.error: BaseException | None = None

    def set(self, i: int) -> None:
        self._loaded[i] = True
        self._ready[i].set()

    def fail(self, exc: BaseException) -> None:
        """The load stopped: waiters on layers that never came are released with the error."""
        self.error = exc
        for e in self._ready:
            e.set()

    def wait(self, i: int) -> None:
        self._ready[i].wait()
        if not self._loaded[i]:
            raise StoreCorrupt(f"layer {i} could not be loaded: {self.error}") from self.error

    @property
    def num_ready(self) -> int:
        return sum(self._loaded)

    def wait_all(self) -> None:
        for i in range(len(self._ready)):
            self.wait(i)


@dataclass
class ModelWeights:
    """Everything outside the layers, plus the layers (filled in the background by a layered load)."""

    embed: torch.Tensor | None  # [V, D]; None when tied to a packed LM head (rows are read from it)
    final_norm: torch.Tensor  # [D]
    lm_head: Linear  # D -> V; shares embed's storage when tied
    layers: list[LayerWeights | None]
    gate: LayerGate | None = None  # set while layers stream in (load_strategy: layered)
    expected_nbytes: int = 0  # what all layers will take (known before a layered load ends)
    tied: bool = False  # the LM head is the embedding (one tensor, counted once)

    def nbytes(self) -> int:
        """Bytes of the model's parameters in the compute dtype (a tied head counted once)."""
        if self.gate is not None and self.expected_nbytes:
            return self.expected_nbytes
        head = 0 if self.tied and self.embed is not None else self.lm_head.nbytes
        emb = 0 if self.embed is None else self.embed.numel() * self.embed.element_size()
        return emb + head + self.final_norm.numel() * self.final_norm.element_size() + sum(
            lw.nbytes() for lw in self.layers if lw is not None
        )

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings [T, D] of token ids [T]."""
        if self.embed is None:
            return self.lm_head.rows(ids)
        return self.embed.index_select(0, ids)

    def layer(self, i: int) -> LayerWeights:
        """Layer i, waiting for it when a layered load is still bringing it in."""
        if self.gate is not None:
            self.gate.wait(i)
        return self.layers[i]

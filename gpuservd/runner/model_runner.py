"""Loads a model and its KV cache onto a device and runs forward passes on chunk lists."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpuservd.errors import UserError
from gpuservd.kv_cache.cache import KVCache, cache_shape
from gpuservd.runner.batch import SeqChunk, build_batch
from gpuservd.runner.llama import LlamaModel
from gpuservd.runner.model_config import ModelArch, load_arch
from gpuservd.runner.load import load_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadReport:
    """How a model load went."""

    model_dir: str
    weight_bytes: int  # in the compute dtype, on the device
    kv_cache_bytes: int
    num_kv_blocks: int
    load_s: float  # reading + converting the weights
    max_model_len: int


class ModelRunner:
    """A model and its paged KV cache on one device."""

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        device: str,
        block_size: int,
        kv_cache_bytes: int | None,
        device_memory_bytes: int,
        kv_cache_fraction: float,
        max_model_len: int | None,
        weight_source=None,
        initial_layers: int | None = None,
        on_layer=None,
    ):
        """weight_source: a tensor source (the host tier's HostCopy, an INT8 file) instead of the
        store's safetensors, or an object whose build_weights(arch, dtype, device, initial_layers,
        on_layer) returns ready weights (weights/delta.py: shared base weights, alone or under a
        variant's delta); initial_layers: layered loading (see weights.load_weights)."""
        t0 = time.perf_counter()
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.arch: ModelArch = load_arch(model_dir)
        limit = self.arch.max_position_embeddings
        if self.arch.sliding_window:
            # We attend over the full context; capping at the window keeps that exact.
            limit = min(limit, self.arch.sliding_window)
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        if hasattr(weight_source, "build_weights"):  # weights shared with other engines (a base + delta, M6)
            weights = weight_source.build_weights(self.arch, self.dtype, self.device, initial_layers=initial_layers,
                                                 on_layer=on_layer)
        else:
            weights = load_weights(weight_source if weight_source is not None else model_dir, self.arch, self.dtype,
                                   self.device, initial_layers=initial_layers, on_layer=on_layer)
        self.weights = weights
        self.model = LlamaModel(self.arch, weights, self.max_model_len, self.dtype, self.device)
        self.block_size = block_size
        shape = cache_shape(self.arch, block_size, self.dtype)
        if kv_cache_bytes is None:
            kv_cache_bytes = int((device_memory_bytes - weights.nbytes()) * kv_cache_fraction)
        if kv_cache_bytes < shape.bytes_per_block:
            raise UserError(
                f"the KV cache budget ({kv_cache_bytes} bytes) holds no {shape.bytes_per_block}-byte block: "
                f"raise engine.device_memory_bytes (weights take {weights.nbytes()} bytes) or set engine.kv_cache_bytes"
            )
        self.cache = KVCache.from_budget(shape, kv_cache_bytes, self.device)
        self.load_report = LoadReport(
            model_dir=str(model_dir),
            weight_bytes=weights.nbytes(),
            kv_cache_bytes=self.cache.bytes,
            num_kv_blocks=self.cache.num_blocks,
            load_s=time.perf_counter() - t0,
            max_model_len=self.max_model_len,
        )

    def execute(self, chunks: list[SeqChunk], suspend=None):
        """One forward over the chunks; logits [S, V] (fp32) for the chunks with sample=True, in order,
        or a LayerCheckpoint if suspend(layer) asked to stop between layers (see resume())."""
        batch = build_batch(chunks, self.block_size, self.device)
        return self.model.forward(batch, self.cache.layer, suspend=suspend)

    def resume(self, checkpoint, between=None) -> torch.Tensor:
        """Finish a suspended forward; logits as execute() would have returned them. between(layer)
        is called after each layer (it may block: the sharing arbiter) and must return False."""
        return self.model.forward(checkpoint.batch, self.cache.layer, suspend=between, resume=checkpoint)

"""A model's weights held in host RAM (the host tier), optionally INT8-compressed.

The disk tier is the store's safetensors files, read through `SafetensorsReader`
(memory-mapped). A `HostCopy` is read from it once; a load from the host tier
then skips the disk entirely, and with compression moves a quarter of the bytes.
Both expose `get(name)` / `has(name)`, so the runner loads from either.
"""

from __future__ import annotations

import time

import torch

from gpuservd.errors import StoreCorrupt
from gpuservd.weights.quant import QTensor, quantizable, quantize_int8


class HostCopy:
    """name -> tensor (or QTensor) for one model, in host memory (pinned on CUDA)."""

    def __init__(self, model: str, tensors: dict, compression: str, read_s: float):
        self.model = model
        self.tensors = tensors
        self.compression = compression  # "none" | "int8"
        self.read_s = read_s  # time it took to build from disk
        # A copy never changes once built; its size is read on every /metrics scrape and status call (a
        # sum over every tensor of the model: a quarter of a scrape's CPU when counted each time).
        self._nbytes = sum(t.nbytes if isinstance(t, QTensor) else t.numel() * t.element_size()
                           for t in tensors.values())

    @classmethod
    def from_reader(cls, model: str, reader, compression: str = "none", pin: bool = False) -> "HostCopy":
        t0 = time.perf_counter()
        tensors: dict = {}
        for name in sorted(reader.name_to_shard):
            t = reader.get(name)
            if compression == "int8" and quantizable(name, t):
                q = quantize_int8(t)
                if pin:
                    q = QTensor(q.q.pin_memory(), q.scale.pin_memory(), q.group_size,
                                None if q.minimum is None else q.minimum.pin_memory())
                tensors[name] = q
            else:
                t = t.contiguous()
                tensors[name] = t.pin_memory() if pin else t.clone()  # clone: own the bytes, not the mmap
        return cls(model, tensors, compression, time.perf_counter() - t0)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def has(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def shape(self, name: str) -> list[int]:
        t = self.tensors[name]
        return list((t.q if isinstance(t, QTensor) else t).shape)

    def get(self, name: str) -> torch.Tensor:
        """The tensor in float (expanded from INT8 if compressed); the caller casts to the compute dtype."""
        t = self.tensors.get(name)
        if t is None:
            raise StoreCorrupt(f"{self.model}: tensor {name!r} is not in its host copy")
        return t.dequantize(torch.float32) if isinstance(t, QTensor) else t

    def get_stored(self, name: str):
        """As held: a QTensor when compressed (the loader expands it on the device), else the tensor."""
        t = self.tensors.get(name)
        if t is None:
            raise StoreCorrupt(f"{self.model}: tensor {name!r} is not in its host copy")
        return t

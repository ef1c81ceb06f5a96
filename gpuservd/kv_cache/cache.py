"""The KV cache tensors, sized from a byte budget.

Layout per layer: k, v = [num_blocks, block_size, kv_heads, head_dim]. Token
major inside a block makes a token's slot one flat index (block * block_size +
offset), so a step's new K/V are written with one index_copy_, and a gathered
block list is a contiguous run of tokens. Layers are the outer dimension, so a
partial-layer swap moves whole per-layer slabs.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from typing import Protocol

import torch

from gpuservd.kv_cache.block_pool import BlockPool

HUGE_PAGES_ENV = "GPUSERV_KV_HUGE_PAGES"


@dataclass(frozen=True)
class CacheShape:
    """What one block holds and what it costs."""

    num_layers: int
    num_kv_heads: int
    block_size: int  # tokens per block
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V of block_size tokens across all layers."""
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * elem


class KVShapeSource(Protocol):
    """What the cache needs of a model's architecture (runner/model_config.py's ModelArch has it).
    The KV cache sits below the runner, so it names the fields it reads instead of importing the runner."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def cache_shape(arch: KVShapeSource, block_size: int, dtype: torch.dtype) -> CacheShape:
    return CacheShape(arch.num_layers, arch.num_kv_heads, block_size, arch.head_dim, dtype)


def _lazy_zeros(dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are zeroed by the kernel when first touched (anonymous memory),
    so a pool of gigabytes costs nothing until its blocks are used; torch.zeros writes every byte up
    front, on the path of a cold start."""
    numel = 1
    for d in dims:
        numel *= d
    nbytes = numel * torch.tensor([], dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(dims, dtype=dtype)
    # Private, not mmap's default MAP_SHARED: shared anonymous memory is shmem, whose first-touch faults
    # cost ~1.5x a private page's (measured on a 2-core KVM guest: ~0.8 vs ~0.6 ms a MB of 4 KB pages),
    # and a decode step that moves into new blocks faults in 3 pages per block per layer for K and V.
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # 2 MB pages where the kernel's transparent huge pages allow (madvise mode): decode attention walks each
    # sequence's 6 KB blocks scattered over a layer's GBs, and with 4 KB pages every block was a TLB miss or
    # two (bf16 attention 1.1-1.2x a layer call with them, 8 x 480 and 48 x 64). A touched block then
    # commits its whole 2 MB page, one fault instead of 512. GPUSERV_KV_HUGE_PAGES=0 keeps 4 KB pages.
    if os.environ.get(HUGE_PAGES_ENV, "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out or disabled: ordinary pages
            pass
    return torch.frombuffer(buf, dtype=dtype).view(dims)  # the tensor keeps the map alive


class KVCache:
    """Device KV storage plus the block pool that hands out its blocks."""

    def __init__(self, shape: CacheShape, num_blocks: int, device: torch.device):
        self.shape = shape
        self.num_blocks = num_blocks
        self.pool = BlockPool(num_blocks)
        # kv: [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]. Zero-filled, not
        # empty: masked-out slots are multiplied by a zero probability, and 0 * NaN garbage is NaN.
        dims = (shape.num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        if device.type == "cpu":
            self.kv = _lazy_zeros(dims, shape.dtype)
        else:
            self.kv = torch.zeros(dims, dtype=shape.dtype, device=device)
        # Each layer's (k, v) views, made once: indexing kv costs ~6 us a layer, every layer of every step.
        self._layers = [(self.kv[i, 0], self.kv[i, 1]) for i in range(shape.num_layers)]

    @classmethod
    def from_budget(cls, shape: CacheShape, budget_bytes: int, device: torch.device) -> "KVCache":
        num_blocks = budget_bytes // shape.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={budget_bytes} holds no block (one block needs {shape.bytes_per_block} bytes)"
            )
        return cls(shape, int(num_blocks), device)

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.shape.bytes_per_block

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of one layer, each [num_blocks, block_size, kv_heads, head_dim]."""
        return self._layers[layer]

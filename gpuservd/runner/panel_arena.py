"""Shared 2 MB-page blocks for a model's layer panels (the packed weights of runner/linear.py).

A decode step streams every layer's panels from DRAM once; on 2 MB pages that stream takes fewer TLB
misses and the hardware prefetchers run on past what would be 4 KB page ends. A panel tensor in a
mapping of its own is on huge pages only for the whole 2 MB pages inside it, and a SmolLM2 layer's
are small (bf16: qkv 1.1 MB, o_proj 0.66, down 1.77, gate_up 3.5): only 117 of a bf16 model's 270 MB
sat on huge pages. Rounding each mapping up to 2 MB would cost up to +42% of the layers' memory. So a
load cuts the layers' panels side by side out of a few large blocks (csrc/packed_panels_f32.cpp
huge_empty: 2 MB-aligned, MADV_HUGEPAGE, whole 2 MB pages), each written once as its tensors are
packed. In the tail14 harness (a step's linears, 2 threads, bf16) 8 rows took 11.3-11.5 ms on
whole-tensor huge pages against 12.9-13.7 with only the whole pages inside each tensor.

Lifetime: every tensor cut from a block is a view of the block's one storage, so the block is
unmapped when the last of its tensors dies (torch's storage refcount; the arena itself drops its
hold on the block it fills when the load ends and the arena goes): an unloaded model's memory goes back. What a model
wastes is the unused end of its blocks: address space only, except the part of the last written
2 MB page past its last tensor (< 2 MB a block). A load reserves its layers' panel bytes (known from
the tensor shapes before anything is read) as its first block, so a model takes one block: SmolLM2's
layers in 64 MB blocks took 4 (bf16), with 5.5 MB of partly used 2 MB pages.

Where huge pages are not given (THP "never", none free) the blocks are ordinary memory with the same
contents; where the kernels are not built, or GPUSERV_PANELS_HUGE_PAGES=0, there is no arena
(`for_load` returns None) and each panel tensor comes from torch's allocator.
"""

from __future__ import annotations

import math
import os
import threading

import torch

from gpuservd.runner import cpu_kernels

HUGE_PAGES_SWITCH = "GPUSERV_PANELS_HUGE_PAGES"
BLOCK_BYTES = 64 << 20  # a block's size (a bf16 SmolLM2 is ~4 of them, an fp32 one ~7)
ALIGN = 4096  # where each tensor starts in its block: on its own cache lines and 4 KB page


def switch_on(name: str) -> bool:
    """An on-by-default switch variable of the runner's packed weights: off with 0, false, no or off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def huge_pages_on() -> bool:
    return switch_on(HUGE_PAGES_SWITCH)


def panel_bytes(n: int, k: int, element_size: int) -> int:
    """What the arena gives the panels of an [n, k] weight (either layout: out padded to whole panels of
    16, pair panels also in to even), aligned."""
    return -(-(-(-n // 16) * 16 * (k + k % 2) * element_size) // ALIGN) * ALIGN


class PanelArena:
    """Hands out uninitialised CPU tensors cut from shared huge-page blocks, in order (a bump allocator).
    One per load, dropped when the load ends (the tensors keep their blocks alive). reserve: the first
    block's size (what the load's panels will take), else blocks of block_bytes."""

    def __init__(self, ops, block_bytes: int = BLOCK_BYTES, reserve: int = 0):
        self._ops = ops
        self.block_bytes = block_bytes
        self._reserve = reserve
        self._block: torch.Tensor | None = None  # the uint8 block being filled
        self._used = 0  # bytes of it handed out (aligned)
        self._lock = threading.Lock()  # a layered load's background thread fills it after the first layers

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of shape and dtype, on 2 MB pages where the kernel gives them."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            if self._block is None or self._used + nbytes > self._block.numel():
                # Past the reserve, a tensor of over half a block (a large model's layer matrices) gets a
                # block of its own, sized to it: the block being filled stays open for the smaller ones.
                if nbytes > self.block_bytes // 2 and not self._reserve:
                    return self._ops.huge_empty(nbytes)[:nbytes].view(dtype).view(shape)
                size, self._reserve = max(self.block_bytes, nbytes, self._reserve), 0
                self._block, self._used = self._ops.huge_empty(size), 0
            block, start = self._block, self._used
            self._used += -(-nbytes // ALIGN) * ALIGN
        return block[start:start + nbytes].view(dtype).view(shape)


def for_load(reserve: int = 0) -> PanelArena | None:
    """An arena for one CPU load's layer panels (reserve: their bytes, panel_bytes summed), or None (no
    kernels, or huge pages switched off)."""
    ops = cpu_kernels.get()
    if ops is None or not hasattr(ops, "huge_empty") or not huge_pages_on():
        return None
    return PanelArena(ops, reserve=reserve)


def mapped_bytes() -> int:
    """Bytes held in huge-page mappings (blocks and panel tensors of their own) that are alive now."""
    ops = cpu_kernels.get()
    return int(ops.panel_mapped_bytes()) if ops is not None and hasattr(ops, "panel_mapped_bytes") else 0

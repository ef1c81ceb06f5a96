"""The host KV pool and the copies that move a preempted request's KV (S3).

A swap-out copies some layers of a request's device blocks into host blocks;
a partial swap keeps the last k layers on the device, packed ("parked") into
as few of the request's own blocks as they fill, so the rest of its device
blocks are really free for others. Resume does the reverse into fresh device
blocks. Every move is a `KVMove`, planned by the scheduler and executed here in
plan order before the step's forward (a block freed by a swap-out may be
written by the same step's forward). On CUDA the host pool is pinned and the
copies run on a side stream that the compute stream waits on; on the CPU they
are plain copies between two tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gpuservd.kv_cache.block_pool import BlockPool
from gpuservd.kv_cache.cache import CacheShape, KVCache


@dataclass
class KVMove:
    """One swap-out or swap-in of one request, as block lists (executed by `Swapper.execute`)."""

    request_id: str
    direction: str  # "out" (device -> host) or "in" (host -> device)
    device_blocks: list[int]  # the request's full device block table (out: source, in: destination)
    host_blocks: list[int]  # one host block per device block
    num_host_layers: int  # layers [0, num_host_layers) travel to / from the host
    park_blocks: list[int] = field(default_factory=list)  # partial swap: where the kept layers are parked
    bytes_moved: int = 0  # filled by execute(): host <-> device bytes
    bytes_parked: int = 0  # filled by execute(): device <-> device bytes
    seconds: float = 0.0  # filled by execute()


def park_slots(num_layers: int, keep: int, blocks: list[int], park: list[int]):
    """Index tensors (src_layers, src_blocks, dst_layers, dst_blocks) that pack layers
    [L - keep, L) of `blocks` into the slabs of `park` (slab f -> layer f % L of park[f // L])."""
    n = len(blocks)
    src_l, src_b, dst_l, dst_b = [], [], [], []
    for j in range(keep):
        for i in range(n):
            f = j * n + i
            src_l.append(num_layers - keep + j)
            src_b.append(blocks[i])
            dst_l.append(f % num_layers)
            dst_b.append(park[f // num_layers])
    return [torch.tensor(x, dtype=torch.long) for x in (src_l, src_b, dst_l, dst_b)]


def num_park_blocks(num_layers: int, keep: int, n: int) -> int:
    """Blocks that hold `keep` layers of `n` blocks once packed."""
    return -(-keep * n // num_layers) if keep else 0


class HostKVPool:
    """Host-side KV blocks, same block shape as the device cache."""

    def __init__(self, shape: CacheShape, budget_bytes: int, pin: bool):
        self.shape = shape
        self.num_blocks = budget_bytes // shape.bytes_per_block
        self.pool = BlockPool(self.num_blocks) if self.num_blocks else None
        self.kv = torch.zeros(
            (shape.num_layers, 2, self.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim),
            dtype=shape.dtype,
            pin_memory=pin,
        )

    @property
    def num_free(self) -> int:
        return self.pool.num_free if self.pool else 0

    @property
    def num_used(self) -> int:
        return self.pool.num_used if self.pool else 0

    def allocate(self, n: int) -> list[int] | None:
        return self.pool.allocate(n) if self.pool and n else ([] if n == 0 else None)

    def free(self, block_ids: list[int]) -> None:
        if block_ids:
            self.pool.free(block_ids)


class Swapper:
    """Executes KVMoves between a device KVCache and a HostKVPool."""

    def __init__(self, cache: KVCache, host: HostKVPool):
        self.cache = cache
        self.host = host
        self.num_layers = cache.shape.num_layers
        self._layer_bytes = cache.shape.bytes_per_block // cache.shape.num_layers  # one layer of one block
        self._cuda = cache.kv.is_cuda
        self._stream = torch.cuda.Stream(device=cache.kv.device) if self._cuda else None

    def execute(self, moves: list[KVMove]) -> None:
        """Run the moves in order; fills each move's bytes and seconds."""
        if not moves:
            return
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream())
        for m in moves:
            t0 = time.perf_counter()
            if self._cuda:
                with torch.cuda.stream(self._stream):
                    self._run(m)
                self._stream.synchronize()  # seconds must be the copy's, and its blocks are reused next
            else:
                self._run(m)
            m.seconds = time.perf_counter() - t0

    def _run(self, m: KVMove) -> None:
        dev = self.cache.kv
        host = self.host.kv
        h = m.num_host_layers
        keep = self.num_layers - h
        dev_idx = torch.tensor(m.device_blocks, dtype=torch.long, device=dev.device)
        host_idx = torch.tensor(m.host_blocks, dtype=torch.long)
        nb = self._cuda
        if m.direction == "out":
            if h:
                moved = dev[:h].index_select(2, dev_idx)
                host[:h].index_copy_(2, host_idx, moved.to("cpu", non_blocking=nb))
            if keep:
                sl, sb, dl, db = (t.to(dev.device) for t in park_slots(self.num_layers, keep, m.device_blocks,
                                                                      m.park_blocks))
                dev[dl, :, db] = dev[sl, :, sb]  # gathered into a temporary first: overlapping slabs are safe
        else:
            if keep:
                sl, sb, dl, db = (t.to(dev.device) for t in park_slots(self.num_layers, keep, m.device_blocks,
                                                                      m.park_blocks))
                # Unpark before the host layers land: the parked slabs sit in layers < h of the park
                # blocks, which are the first blocks of the new table. Gathered first, so overlap is safe.
                dev[sl, :, sb] = dev[dl, :, db]
            if h:
                back = host[:h].index_select(2, host_idx).to(dev.device, non_blocking=nb)
                dev[:h].index_copy_(2, dev_idx, back)
        n = len(m.device_blocks)
        m.bytes_moved = n * h * self._layer_bytes
        m.bytes_parked = 2 * n * keep * self._layer_bytes  # read + write

    def probe_bandwidth(self, num_blocks: int = 4) -> float | None:
        """Device -> host -> device copy bandwidth in bytes/s on spare blocks, or None if none are spare."""
        n = min(num_blocks, self.cache.pool.num_free, self.host.num_free)
        if n < 1:
            return None
        dev = self.cache.pool.allocate(n)
        hst = self.host.allocate(n)
        try:
            moves = [KVMove("probe", "out", dev, hst, self.num_layers), KVMove("probe", "in", dev, hst, self.num_layers)]
            self.execute(moves)
            self.execute(moves)  # the first pass pays for page faults
            secs = sum(m.seconds for m in moves)
            return sum(m.bytes_moved for m in moves) / secs if secs > 0 else None
        finally:
            self.cache.pool.free(dev)
            self.host.free(hst)

"""The host KV pool and the copies that move a preempted request's KV out of the device and back.

A swap-out copies some layers of a request's device blocks into host blocks;
a partial swap keeps the last k layers on the device, packed ("parked") into
as few of the request's own blocks as they fill, so the rest of its device
blocks are really free for others. Resume does the reverse into fresh device
blocks. Every move is a `KVMove`, planned by the scheduler and executed here in
plan order before the step's forward (a block freed by a swap-out may be
written by the same step's forward). On CUDA the host pool is pinned and the
copies run on side streams: the forward waits for the device-side part of the
moves, and the swap-outs' copies to the host run beside it (`Swapper`); on
the CPU they are plain copies between two tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gpuservd.background import in_background
from gpuservd.events.types import SwapMove
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

    def event(self) -> SwapMove:
        """The move as the event stream and the step record report it."""
        return SwapMove(request_id=self.request_id, direction=self.direction, blocks=len(self.device_blocks),
                        host_layers=self.num_host_layers, bytes_moved=self.bytes_moved,
                        bytes_parked=self.bytes_parked, seconds=self.seconds)


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
    """Host-side KV blocks, same block shape as the device cache.

    Block-major ([block, layer, k|v, slot, head, dim]): each host block's layers are one contiguous
    run of bytes, so on CUDA a block's copy is one DMA straight into pinned memory, which can run
    asynchronously (a copy into a strided host view could not)."""

    def __init__(self, shape: CacheShape, budget_bytes: int, pin: bool):
        self.shape = shape
        self.num_blocks = budget_bytes // shape.bytes_per_block
        self.pool = BlockPool(self.num_blocks) if self.num_blocks else None
        size = (self.num_blocks, shape.num_layers, 2, shape.block_size, shape.num_kv_heads, shape.head_dim)
        # Not zeroed: a host block is always written (swap-out) before it is read (swap-in), and zeroing
        # 512 MB touched every page on each engine's start (0.13 s of a SmolLM2 load on this CPU).
        self._kv: torch.Tensor | None = None
        self._pending_kv = None
        if pin and self.num_blocks:
            # Page-locking the whole pool happens at allocation (cudaHostAlloc), a fraction of a second
            # for 512 MB: done beside the model's load, waited for only by the first swap.
            self._pending_kv = in_background("host-kv-pool", torch.empty, size, dtype=shape.dtype, pin_memory=True)
        else:
            self._kv = torch.empty(size, dtype=shape.dtype, pin_memory=pin)

    @property
    def kv(self) -> torch.Tensor:
        """The pool's tensor [block, layer, k|v, slot, head, dim] (waits for a pinned allocation in flight)."""
        if self._kv is None and self._pending_kv is not None:
            self._kv = self._pending_kv.result()  # the allocation's own error, if it failed
        return self._kv

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


def host_runs(host_blocks: list[int], whole: bool) -> list[tuple[int, int, int]]:
    """(index into the move's blocks, first host block, count) per copy: runs of consecutive host blocks
    when whole blocks travel (a run is one contiguous range of the block-major pool), else one block
    each (some layers of a block are contiguous, but not across blocks). Each copy costs the host an
    enqueue (~10 us): a 16k-token swap-out as 1024 copies spent more time on the CPU than its DMA."""
    runs: list[tuple[int, int, int]] = []
    for i, hb in enumerate(host_blocks):
        if whole and runs and runs[-1][1] + runs[-1][2] == hb:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, hb, 1))
    return runs


def _to_block_major(t: torch.Tensor) -> torch.Tensor:
    """[layer, k|v, block, ...] -> [block, layer, k|v, ...] (a view)."""
    return t.permute(2, 0, 1, 3, 4, 5)


def _to_layer_major(t: torch.Tensor) -> torch.Tensor:
    """[block, layer, k|v, ...] -> [layer, k|v, block, ...] (a view)."""
    return t.permute(1, 2, 0, 3, 4, 5)


class Swapper:
    """Executes KVMoves between a device KVCache and a HostKVPool.

    On the CPU, `execute` copies and returns with each move's bytes and seconds filled. On CUDA it
    only enqueues, so the copies run beside the step's forward:
      - the swap stream waits for the compute stream (the last forward wrote the blocks), then in
        plan order gathers each swap-out's device blocks into a staging tensor, parks / unparks,
        and brings each swap-in's host blocks in (pinned -> device) and scatters them;
      - the compute stream waits for that (the forward may write the blocks a swap-out freed, and
        reads the blocks a swap-in filled), but not for the swap-outs' device -> host copies, which
        run on a third stream from the staging tensors into pinned host blocks while the forward runs;
      - `finish()`, called after the forward, waits for those copies and fills each move's seconds
        from CUDA events (the copy's own time on its streams, not the host's enqueue time).
    A later swap-in of host blocks still in flight is ordered after their copy (the swap stream
    waits for the copy stream first)."""

    def __init__(self, cache: KVCache, host: HostKVPool):
        self.cache = cache
        self.host = host
        self.num_layers = cache.shape.num_layers
        self._layer_bytes = cache.shape.bytes_per_block // cache.shape.num_layers  # one layer of one block
        self._cuda = cache.kv.is_cuda
        if self._cuda:
            self._stream = torch.cuda.Stream(device=cache.kv.device)  # gathers, parking, swap-ins
            self._d2h = torch.cuda.Stream(device=cache.kv.device)  # swap-outs' device -> host copies
        self._pending: list[tuple[KVMove, object, object]] = []  # CUDA: (move, start event, end event)

    def execute(self, moves: list[KVMove]) -> None:
        """Run (CPU) or enqueue (CUDA) the moves in order. On the CPU each move's seconds are filled
        here; on CUDA by `finish()`."""
        if not moves:
            return
        if not self._cuda:
            for m in moves:
                t0 = time.perf_counter()
                self._run_cpu(m)
                m.seconds = time.perf_counter() - t0
            return
        compute = torch.cuda.current_stream(self.cache.kv.device)
        self._stream.wait_stream(compute)
        self._stream.wait_stream(self._d2h)  # host blocks written by earlier swap-outs are complete
        with torch.cuda.stream(self._stream):
            for m in moves:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self._stream)
                self._run_cuda(m, end)
                self._pending.append((m, start, end))
        compute.wait_stream(self._stream)

    def finish(self) -> None:
        """CUDA: wait for the swap-outs' copies to the host and fill every enqueued move's seconds.
        A no-op on the CPU and when nothing is pending."""
        if not self._pending:
            return
        self._d2h.synchronize()
        self._stream.synchronize()
        for m, start, end in self._pending:
            m.seconds = start.elapsed_time(end) / 1000.0
        self._pending.clear()

    def _park(self, m: KVMove, keep: int) -> None:
        """Partial swap: pack (out) or unpack (in) the kept layers. Gathered into a temporary first,
        so overlapping slabs are safe."""
        dev = self.cache.kv
        sl, sb, dl, db = (t.to(dev.device) for t in park_slots(self.num_layers, keep, m.device_blocks,
                                                                 m.park_blocks))
        if m.direction == "out":
            dev[dl, :, db] = dev[sl, :, sb]
        else:
            # Unpark before the host layers land: the parked slabs sit in layers < h of the park
            # blocks, which are the first blocks of the new table.
            dev[sl, :, sb] = dev[dl, :, db]

    def _account(self, m: KVMove, h: int, keep: int) -> None:
        n = len(m.device_blocks)
        m.bytes_moved = n * h * self._layer_bytes
        m.bytes_parked = 2 * n * keep * self._layer_bytes  # read + write

    def _run_cpu(self, m: KVMove) -> None:
        dev, host = self.cache.kv, self.host.kv
        h = m.num_host_layers
        keep = self.num_layers - h
        dev_idx = torch.tensor(m.device_blocks, dtype=torch.long)
        host_idx = torch.tensor(m.host_blocks, dtype=torch.long)
        if m.direction == "out":
            if h:
                host[:, :h].index_copy_(0, host_idx, _to_block_major(dev[:h].index_select(2, dev_idx)))
            if keep:
                self._park(m, keep)
        else:
            if keep:
                self._park(m, keep)
            if h:
                dev[:h].index_copy_(2, dev_idx, _to_layer_major(host[:, :h].index_select(0, host_idx)))
        self._account(m, h, keep)

    def _run_cuda(self, m: KVMove, end) -> None:
        """Enqueue one move on the swap stream (and, for a swap-out's host copy, the copy stream);
        records `end` where the move's last copy is enqueued."""
        dev, host = self.cache.kv, self.host.kv
        h = m.num_host_layers
        keep = self.num_layers - h
        dev_idx = torch.tensor(m.device_blocks, dtype=torch.long).to(dev.device, non_blocking=True)
        if m.direction == "out":
            staged = None
            if h:  # staged before parking: parking may overwrite these blocks' low layers
                staged = _to_block_major(dev[:h].index_select(2, dev_idx)).contiguous()
            if keep:
                self._park(m, keep)
            if staged is not None:
                self._d2h.wait_stream(self._stream)
                with torch.cuda.stream(self._d2h):
                    for i, hb, k in host_runs(m.host_blocks, whole=h == self.num_layers):
                        host[hb:hb + k, :h].copy_(staged[i:i + k], non_blocking=True)
                    staged.record_stream(self._d2h)  # its memory is not reused before the copies end
                    end.record(self._d2h)
            else:
                end.record(self._stream)
        else:
            if keep:
                self._park(m, keep)
            if h:
                staged = torch.empty((len(m.host_blocks), h) + tuple(host.shape[2:]), dtype=host.dtype,
                                     device=dev.device)
                for i, hb, k in host_runs(m.host_blocks, whole=h == self.num_layers):
                    staged[i:i + k].copy_(host[hb:hb + k, :h], non_blocking=True)
                dev[:h].index_copy_(2, dev_idx, _to_layer_major(staged))
            end.record(self._stream)
        self._account(m, h, keep)

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
            self.finish()
            self.execute(moves)  # the first pass pays for page faults
            self.finish()
            secs = sum(m.seconds for m in moves)
            return sum(m.bytes_moved for m in moves) / secs if secs > 0 else None
        finally:
            self.cache.pool.free(dev)
            self.host.free(hst)


_HOST_BANDWIDTH: dict[str, float] = {}  # dtype -> the RAM copy bandwidth the process's first CPU engine measured


def host_bandwidth(swapper: Swapper, dtype: str) -> float | None:
    """The CPU's swap bandwidth (a memory copy): probed by the first engine of the process and kept, so
    an engine built for a cold request does not pay for the probe (real swaps refine the estimate)."""
    if dtype not in _HOST_BANDWIDTH:
        measured = swapper.probe_bandwidth()
        if measured is None:
            return None
        _HOST_BANDWIDTH[dtype] = measured
    return _HOST_BANDWIDTH[dtype]

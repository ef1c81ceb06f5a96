"""Committing a CPU KV pool's memory ahead of its use, a page at a time, while its engine is idle.

The pool is anonymous memory the kernel commits and zeroes when a page is first written (cache.py:
_lazy_zeros), so a cold start pays nothing for gigabytes it may never use. The price moves to the steps
that first write each block: the write faults in a 2 MB page inside a parallel op (the K/V copy), and the
other threads wait at its barrier. Where the hypervisor backs a VM's memory lazily as well, that fault is
slow: on the 2-core Firecracker guest of the benchmarks ~6 ms a 2 MB page (SmolLM2's 1.6 GB pool took
4.2-5.2 s to commit), and the mixed burst's short phase (scripts/burst_breakdown.py --until short, bf16,
2 threads) ran 4.05-4.31 s with those faults in its steps (0.48-0.57 s of system time) against
3.44-3.53 s on pages already committed (0.02-0.06 s). On bare metal a page costs ~0.2 ms.

So an idle engine loop commits its pool (`PoolCommitter.commit_next`, one 2 MB page of one layer's K or V
per call, the loop checking for work between calls) with MADV_POPULATE_WRITE (Linux 5.14+): pages are
allocated and mapped writable as a write would, but nothing is written, so blocks holding K/V keep it. It
goes in the order the pool first hands blocks out (block 0 up, every layer's K and V), and stops for good
when all is committed, when the kernel refuses the advice (an older kernel: the pool stays lazy, as
before), or when committing more would leave the machine less than MIN_AVAILABLE_FRACTION of its memory
available (a pool sized past what is free keeps its tail lazy). A request arriving meanwhile waits for at
most the page in progress. GPUSERV_KV_PREFAULT=0 turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref

log = logging.getLogger(__name__)

PREFAULT_ENV = "GPUSERV_KV_PREFAULT"
MADV_POPULATE_WRITE = 23  # linux/mman.h (5.14+); Python 3.11's mmap module does not name it
CHUNK_BYTES = 2 << 20  # a 2 MB page of one layer's K or V per call
PAGE = 4096
MIN_AVAILABLE_FRACTION = 0.10  # commit nothing more while less than this share of RAM is available

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        libc = ctypes.CDLL(None, use_errno=True)  # a CDLL call releases the interpreter's lock
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _madvise = libc.madvise
    return _madvise


def resident_fraction(addr: int, length: int) -> float:
    """The share of the 4 KB pages under [addr, addr + length) that are in memory (mincore(2)); OSError
    where the kernel refuses (an unmapped range)."""
    start = addr - addr % PAGE
    pages = (addr + length - start + PAGE - 1) // PAGE
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * PAGE), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) / pages


def enabled() -> bool:
    return os.environ.get(PREFAULT_ENV, "1") != "0"


def available_fraction() -> float:
    """MemAvailable / MemTotal from /proc/meminfo (1.0 where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[1:]}
        return info["MemAvailable"] / info["MemTotal"]
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return 1.0


class PoolCommitter:
    """Commits a CPU KV pool ([num_layers, 2, num_blocks, ...]) a page at a time, in block order."""

    def __init__(self, cache):
        kv = cache.kv
        self._ref = weakref.ref(cache)  # an unloaded model's pool is freed, not kept alive for this
        self.num_layers, halves, self.num_blocks = kv.shape[:3]
        self.num_regions = self.num_layers * halves  # every layer's K, then its V
        self.block_bytes = kv[0, 0, 0].numel() * kv.element_size()  # one block of one region
        self.blocks_per_call = max(1, CHUNK_BYTES // self.block_bytes)
        self.next_block = 0  # the blocks before it are committed in every region
        self.next_region = 0
        self.done = False
        self.num_committed_bytes = 0

    @classmethod
    def for_cache(cls, cache) -> "PoolCommitter | None":
        """A committer for a CPU pool where GPUSERV_KV_PREFAULT allows (None otherwise)."""
        if cache is None or not enabled() or cache.kv.device.type != "cpu" or not cache.kv.numel():
            return None
        return cls(cache)

    def span(self, base: int, region: int, first: int, last: int) -> tuple[int, int]:
        """(address, length) of blocks [first, last) of one region of the pool at `base`, widened to whole
        4 KB pages."""
        start = base + (region * self.num_blocks + first) * self.block_bytes
        end = base + (region * self.num_blocks + last) * self.block_bytes
        start -= start % PAGE
        end += -end % PAGE
        return start, end - start

    def commit_next(self) -> None:
        """Commit the next page; sets `done` when nothing is left to do (or nothing more may be done)."""
        if self.done:
            return
        cache = self._ref()
        if cache is None or (self.next_region == 0 and available_fraction() < MIN_AVAILABLE_FRACTION):
            self.done = True
            return
        last = min(self.num_blocks, self.next_block + self.blocks_per_call)
        addr, length = self.span(cache.kv.data_ptr(), self.next_region, self.next_block, last)
        if _libc_madvise()(addr, length, MADV_POPULATE_WRITE) != 0:
            log.debug("MADV_POPULATE_WRITE refused (%s): the KV pool stays committed on first write",
                      os.strerror(ctypes.get_errno()))
            self.done = True
            return
        del cache
        self.num_committed_bytes += length
        self.next_region += 1
        if self.next_region == self.num_regions:
            self.next_region = 0
            self.next_block = last
            self.done = last >= self.num_blocks

    def commit_all(self) -> None:
        while not self.done:
            self.commit_next()

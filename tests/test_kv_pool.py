"""The paged KV block pool: allocation, reference counts, sizing."""

import pytest
import torch

from gpuservd.kv_cache.block_pool import BlockPool
from gpuservd.kv_cache.cache import CacheShape, KVCache


def test_allocate_free_refcount():
    pool = BlockPool(8)
    a = pool.allocate(5)
    assert len(a) == 5 and pool.num_free == 3 and pool.usage == 5 / 8
    assert pool.allocate(4) is None and pool.num_free == 3  # all or nothing
    pool.share(a[:2])
    pool.free(a)
    assert pool.num_free == 6  # the two shared blocks still have a reference
    pool.free(a[:2])
    assert pool.num_free == 8
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([a[0]])
    with pytest.raises(ValueError, match="is free"):
        pool.share([a[0]])


def test_cache_sized_from_budget():
    shape = CacheShape(num_layers=30, num_kv_heads=3, block_size=16, head_dim=64, dtype=torch.float32)
    assert shape.bytes_per_block == 2 * 30 * 3 * 16 * 64 * 4  # 737,280 bytes
    cache = KVCache.from_budget(shape, 100 * shape.bytes_per_block + 5, torch.device("cpu"))
    assert cache.num_blocks == 100 and cache.pool.num_free == 100
    assert cache.layer(3)[0].shape == (100, 16, 3, 64)
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.from_budget(shape, 10, torch.device("cpu"))


def test_host_runs_merge_consecutive_whole_blocks_only():
    from gpuservd.kv_cache.swap import host_runs

    assert host_runs([4, 5, 6, 9, 10, 2], whole=True) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert host_runs([4, 5, 6], whole=False) == [(0, 4, 1), (1, 5, 1), (2, 6, 1)]
    assert host_runs([], whole=True) == []


def test_pinned_host_pool_is_allocated_beside_the_load():
    """A pinned pool is allocated on a thread; its bookkeeping does not wait, and the allocation's own
    error (no pinned allocator on a CPU build) surfaces where the pool is first used."""
    import torch

    from gpuservd.kv_cache.cache import CacheShape
    from gpuservd.kv_cache.swap import HostKVPool

    shape = CacheShape(num_layers=2, num_kv_heads=1, block_size=4, head_dim=8, dtype=torch.float32)
    pool = HostKVPool(shape, 8 * shape.bytes_per_block, pin=True)
    assert pool.num_free == 8 and pool.allocate(3) is not None
    if torch.cuda.is_available():
        assert pool.kv.is_pinned() and tuple(pool.kv.shape) == (8, 2, 2, 4, 1, 8)
    else:
        with pytest.raises(RuntimeError, match="pin"):
            pool.kv


def test_layer_views_are_made_once_and_see_the_cache():
    """layer(i) hands out the same (k, v) views every step (made at construction: indexing the cache per
    layer and step cost microseconds each), and they are views of the cache, not copies."""
    cache = KVCache(CacheShape(num_layers=3, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.float32), 5,
                    torch.device("cpu"))
    k1, v1 = cache.layer(1)
    assert cache.layer(1)[0] is k1 and cache.layer(1)[1] is v1
    k1[2, 3, 1].fill_(7.0)
    v1[4, 0, 0].fill_(-2.0)
    assert cache.kv[1, 0, 2, 3, 1].eq(7.0).all() and cache.kv[1, 1, 4, 0, 0].eq(-2.0).all()
    assert cache.kv[0].eq(0).all() and cache.kv[2].eq(0).all()
    assert k1.shape == (5, 4, 2, 8)


def test_cpu_kv_pool_is_private_anonymous_memory():
    """The CPU pool is a private anonymous mapping (first-touch faults are cheaper than shared memory's),
    zero and lazily backed."""
    import sys
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/self/maps")
    cache = KVCache(CacheShape(2, 2, 4, 8, torch.float32), 4096, torch.device("cpu"))
    addr = cache.kv.data_ptr()
    for line in open("/proc/self/maps"):
        span, perms = line.split()[:2]
        lo, hi = (int(x, 16) for x in span.split("-"))
        if lo <= addr < hi:
            assert perms == "rw-p", line
            break
    else:
        pytest.fail("the pool's address is in no mapping")
    assert cache.layer(1)[0].abs().sum().item() == 0


def test_freed_blocks_without_content_are_reused_before_unused_and_cached_ones():
    """A freed block with no content hash is handed out next (memory already written, no cached block
    evicted); a freed cached block waits at the back of the queue (LRU)."""
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert a == [0, 1, 2]
    pool.cache(a[0], b"h0")
    pool.free(a[::-1])  # 2, 1 uncached; 0 cached
    assert pool.allocate(2) == [1, 2]  # the freed uncached ones, not 3 and 4 (never used)
    assert pool.lookup(b"h0") == 0
    assert pool.allocate(5) == [3, 4, 5, 6, 7]
    assert pool.allocate(1) == [0] and pool.num_evicted == 1  # the cached block goes last

"""The KV cache manager: it alone changes block tables, and every change it makes is a move or a count."""

from __future__ import annotations

import pytest

from gpuservd.engine.request import Request, SamplingParams
from gpuservd.kv_cache.block_pool import BlockPool
from gpuservd.kv_cache.manager import KVCacheManager


def make_manager(num_blocks=16, host_blocks=16, block_size=4, num_layers=4):
    host = BlockPool(host_blocks) if host_blocks else None
    return KVCacheManager(BlockPool(num_blocks), block_size, host, num_layers)


def req(rid="a", n=10, computed=0):
    r = Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=8))
    r.num_computed_tokens = computed
    return r


def test_allocate_slots_grows_the_table_all_or_nothing():
    kv = make_manager(num_blocks=4)
    r = req(n=10)
    assert kv.blocks_needed(r, 10) == 3
    got = kv.allocate_slots(r, 10)
    assert got == kv.table(r) and len(got) == 3 and kv.pool.num_free == 1
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2) == [] and kv.blocks_needed(r, 3) == 1  # 12 tokens fit in 3 blocks
    other = req("b", n=9)
    assert kv.allocate_slots(other, 9) is None and kv.pool.num_free == 1 and kv.table(other) == []
    kv.free(r)
    assert kv.pool.num_free == 4 and kv.table(r) == []


def test_drop_oldest_keeps_the_tail_and_refills_in_front():
    kv = make_manager()
    r = req(n=16)
    kv.allocate_slots(r, 16)
    first, tail = kv.table(r)[:2], kv.table(r)[2:]
    assert kv.drop_oldest(r, 2) == 2 and kv.table(r) == tail and kv.pool.num_free == 14
    assert kv.blocks_needed(r, 1) == 2  # the dropped blocks, whatever the chunk
    new = kv.allocate_slots(r, 1)
    assert kv.table(r) == new + tail and len(new) == 2
    with pytest.raises(ValueError):
        kv.drop_oldest(r, 4)  # all of it is not a drop of the oldest: that is free()
    assert set(first) | set(new) <= set(range(16))


@pytest.mark.parametrize("keep", [0, 2])
def test_swap_out_and_in_return_the_moves_and_book_the_blocks(keep):
    kv = make_manager(num_layers=4)
    r = req(n=20, computed=20)
    kv.allocate_slots(r, 0)
    table = list(kv.table(r))
    assert len(table) == 5 and kv.can_swap_out(r)
    move, freed = kv.swap_out(r, keep)
    parked = kv.park_blocks_for(5, keep)  # 2 of 4 layers of 5 blocks pack into 3 blocks
    assert parked == (0 if keep == 0 else 3) and freed == 5 - parked
    assert move.direction == "out" and move.device_blocks == table and move.num_host_layers == 4 - keep
    assert move.park_blocks == table[:parked] and len(move.host_blocks) == 5
    assert kv.is_swapped(r) and kv.table(r) == [] and kv.num_device_blocks(r) == parked
    assert kv.num_host_blocks(r) == 5 and kv.host.num_used == 5 and kv.pool.num_used == parked
    assert kv.blocks_needed(r, 1) == 5 - parked + 1  # position 20 opens a sixth block
    back = kv.swap_in(r, 1)
    assert back.direction == "in" and back.host_blocks == move.host_blocks and back.park_blocks == move.park_blocks
    assert kv.table(r)[:parked] == move.park_blocks and len(kv.table(r)) == 6 and back.device_blocks == kv.table(r)[:5]
    assert not kv.is_swapped(r) and kv.host.num_used == 0
    kv.free(r)
    assert kv.pool.num_free == 16


def test_swap_in_takes_nothing_when_the_pool_is_short():
    kv = make_manager(num_blocks=6)
    r = req(n=20, computed=20)
    kv.allocate_slots(r, 0)
    kv.swap_out(r)
    hog = req("hog", n=8)
    kv.allocate_slots(hog, 8)  # 2 blocks; 4 left, r needs 5
    assert kv.swap_in(r, 1) is None and kv.is_swapped(r) and kv.pool.num_free == 4
    kv.free(r)
    assert kv.host.num_used == 0 and kv.pool.num_free == 4

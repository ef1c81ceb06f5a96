"""An idle engine commits its CPU KV pool ahead of the blocks' first writes (kv_cache/prefault.py). Which
pages are resident is read from the kernel with mincore(2); real pools, a real engine loop on the tiny model."""

from __future__ import annotations

import gc
import threading
import time

import torch

from gpuservd.engine.loop import EngineLoop, Submission
from gpuservd.engine.request import RequestOutput, SamplingParams
from gpuservd.kv_cache import prefault
from gpuservd.kv_cache.cache import CacheShape, KVCache

from test_engine import make_engine

def resident(t: torch.Tensor) -> float:
    """The share of the 4 KB pages under a contiguous tensor that are in memory."""
    return prefault.resident_fraction(t.data_ptr(), t.numel() * t.element_size())


def pool(mib: int) -> KVCache:
    # 4 layers, 2 KV heads of 64 dims, 16-token blocks, fp32: 8 KB a block in each layer's K and V
    return KVCache.from_budget(CacheShape(4, 2, 16, 64, torch.float32), mib << 20, torch.device("cpu"))


def test_the_committer_commits_the_pool_in_block_order_and_keeps_what_blocks_hold():
    c = pool(64)  # 1024 blocks: 8 MB per layer's K or V, 4 calls of 2 MB each
    assert resident(c.kv) == 0.0  # nothing written: nothing committed
    c.kv[1, 0, 5].fill_(3.0)
    c.kv[3, 1, -1].fill_(-2.0)
    com = prefault.PoolCommitter(c)
    assert (com.num_regions, com.blocks_per_call) == (8, 256)
    for _ in range(com.num_regions):  # the first 256 blocks of every layer's K and V
        com.commit_next()
    assert all(resident(c.kv[layer, half, :256]) == 1.0 for layer in range(4) for half in range(2))
    assert resident(c.kv[0, 0, 512:]) < 0.5  # later blocks wait their turn
    com.commit_all()
    assert com.done and com.num_committed_bytes >= 64 << 20
    assert resident(c.kv) == 1.0
    # committed as a write would, and nothing written: the blocks in use keep their K/V, the rest is zero
    assert c.kv[1, 0, 5].eq(3.0).all() and c.kv[3, 1, -1].eq(-2.0).all()
    assert float(c.kv.abs().sum()) == 5.0 * c.kv[0, 0, 0].numel()


def test_a_committer_lets_an_unloaded_pool_go_and_stops():
    c = pool(16)
    com = prefault.PoolCommitter.for_cache(c)
    assert com is None  # the suite turns it off (conftest): idle engines in other tests commit nothing
    com = prefault.PoolCommitter(c)
    com.commit_next()
    del c
    gc.collect()
    com.commit_next()  # the cache is gone: nothing is kept alive, nothing more is done
    assert com.done


def test_an_idle_engine_loop_commits_its_pool_and_still_serves(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(prefault.PREFAULT_ENV, "1")

    class Posted:
        def call_soon_threadsafe(self, fn, deliveries, events):
            fn(deliveries, events)

    finished = threading.Event()
    got: list[RequestOutput] = []

    class Sink:
        def put(self, item):
            if isinstance(item, RequestOutput):
                got.append(item)
                if item.finished:
                    finished.set()

    loop = EngineLoop("tiny", lambda: make_engine(tiny_model_dir, kv_cache_bytes=32 << 20), Posted(),
                      lambda deliveries, events: [sink.put(item) for sink, item in deliveries])
    loop.start()
    try:
        kv = loop.ready.result(60).runner.cache.kv
        deadline = time.monotonic() + 60
        while resident(kv) < 1.0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert resident(kv) == 1.0  # nothing was written: the idle loop committed it all
        loop.submit(Submission("r0", [3, 4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True), Sink()))
        assert finished.wait(60)
        assert sum(len(o.new_token_ids) for o in got) == 5
    finally:
        loop.stop()


def test_the_bench_commits_its_in_process_engines_pool_as_the_idle_daemon_does(tiny_model_dir, monkeypatch):
    from gpuservd.bench.engine_run import commit_kv_pool

    engine = make_engine(tiny_model_dir, kv_cache_bytes=16 << 20)
    kv = engine.runner.cache.kv
    assert commit_kv_pool(engine) == 0  # GPUSERV_KV_PREFAULT=0 (the suite's setting): left lazy, as the daemon would
    monkeypatch.setenv(prefault.PREFAULT_ENV, "1")
    before = resident(kv)
    assert commit_kv_pool(engine) >= kv.numel() * kv.element_size() * (1 - before)
    assert resident(kv) == 1.0
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0]) == 3  # and it serves

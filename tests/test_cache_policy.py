"""The weight cache's eviction and prefetch policy on traces (no models loaded)."""

from __future__ import annotations

import pytest

from gpuservd.errors import UserError
from gpuservd.weights.cache import CacheFull, WeightCache
from gpuservd.weights.config import CacheConfig
from gpuservd.weights.prefetch import Predictor
from gpuservd.weights.trace_sim import belady, make_trace, replay


def test_belady_on_a_hand_trace():
    # cache 2: a b c a b c -> misses a, b, c(evict the later-used b? next uses: a@3, b@4 -> evict b), a hit, b miss, c hit
    assert belady(list("abcabc"), 2)["hits"] == 2


def test_lru_eviction_respects_pinned_busy_and_keep_alive():
    c = WeightCache(CacheConfig(cache_size=2, keep_alive_s=100.0), device_budget=1000)
    c.device_loaded("a", 100, pinned=True)
    c.device_loaded("b", 100)
    c.device["b"].last_used -= 1000  # idle for long
    assert c.plan_device_load("c", 100, busy=set()) == ["b"]
    with pytest.raises(CacheFull, match="pinned, busy or kept alive"):
        c.plan_device_load("c", 100, busy={"b"})
    c.device["b"].last_used += 1000  # used just now: kept alive
    with pytest.raises(CacheFull):
        c.plan_device_load("c", 100, busy=set())
    with pytest.raises(UserError, match="needs 0.0 MB of weights but the device tier holds 0.0 MB"):
        c.plan_device_load("huge", 2000, busy=set())


def test_a_requests_keep_alive_guards_its_model_until_it_runs_out():
    # the daemon's view: model -> seconds its last request's keep_alive still holds (no config keep_alive here)
    c = WeightCache(CacheConfig(cache_size=2), device_budget=1000)
    for m, t in (("a", 1), ("b", 2)):
        c.device_loaded(m, 100)
        c.device[m].last_used = t
    assert c.plan_device_load("c", 100, busy=set(), kept={}) == ["a"]  # plain LRU
    assert c.plan_device_load("c", 100, busy=set(), kept={"a": 30.0}) == ["b"]  # a is kept: the next one goes
    with pytest.raises(CacheFull, match="first keep_alive in the way ends in 12 s") as full:
        c.plan_device_load("c", 100, busy=set(), kept={"a": 30.0, "b": 12.0})
    assert full.value.retry_after_s == 12.0
    assert c.plan_device_load("c", 100, busy=set(), kept={"a": -0.5, "b": 12.0}) == ["a"]  # a's ran out
    with pytest.raises(CacheFull) as full:
        c.plan_device_load("c", 100, busy={"a"}, kept={"b": 12.0})
    assert full.value.retry_after_s == 12.0
    c.set_pinned("b", True)
    with pytest.raises(CacheFull) as full:
        c.plan_device_load("c", 100, busy={"a"}, kept={})
    assert full.value.retry_after_s is None  # pinned and busy: no keep_alive to wait out


def test_byte_budget_evicts_until_it_fits():
    c = WeightCache(CacheConfig(cache_size=10), device_budget=1000)
    for m, t in (("a", 1), ("b", 2), ("c", 3)):
        c.device_loaded(m, 300)
        c.device[m].last_used = t
    assert c.plan_device_load("d", 500, busy=set()) == ["a", "b"]  # least recently used first, until 500 fit


def test_predictor_learns_switches_not_repeats():
    p = Predictor(min_prob=0.2)
    for m in ["a", "a", "b", "a", "a", "b", "a", "c"]:
        p.observe(m)
    nxt = dict(p.next_models("a"))
    assert set(nxt) == {"b", "c"} and nxt["b"] > nxt["c"] and "a" not in nxt


def test_trace_hit_rates_order_and_prefetch_helps():
    trace, meta = make_trace(num_requests=3000)
    assert meta["models"] == 32 and 0.7 < meta["top10_share"] < 0.9
    for k in (3, 10):
        lru, pre, opt = replay(trace, k, False), replay(trace, k, True), belady(trace, k)
        assert lru["hit_rate"] <= opt["hit_rate"]  # nothing beats the offline optimum of demand caching
        assert pre["hit_rate"] > lru["hit_rate"]  # the workflows are learnable
        s = pre["prefetch_stats"]
        assert s["issued"] >= s["used"] + s["wasted"] and 0 < s["accuracy"] <= 1


def test_the_hit_rate_window_is_checked_and_sizes_the_watch():
    from gpuservd.weights.prefetch import HitRateWatch

    with pytest.raises(UserError, match="cache.hit_rate_window must be >= 2, got 1"):
        CacheConfig(hit_rate_window=1).validate()
    watch = HitRateWatch(CacheConfig(hit_rate_window=4).hit_rate_window)
    assert [watch.observe(m, False, 0.9, 1) for m in "abc"] == [None, None, None]  # not full yet
    alert = watch.observe("a", False, 0.9, 1)
    assert alert["window"] == 4 and alert["models_for_90pct"] == 3 and alert["suggested_cache_size"] == 3

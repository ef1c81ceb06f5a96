"""Hint rules fired through the daemon's own Serving (in-process, no socket): real engines, the real weight
cache and arbiter, every event on the daemon's bus reaching its HintMonitor, and the daemon's evaluation
(`serving.hints.tick(serving)`, what the daemon runs once a second) deciding.

- cache_hit_rate_low and load_after_evict: three models through a device tier of one (cache_size 1), asked
  for in turn, then a burst of requests for the model just evicted; the same traffic with room for all three
  leaves both quiet.

tests/test_hints_engine.py lists where the other rules fire, and the ones a CPU cannot produce.
"""

from __future__ import annotations

import asyncio

import pytest

from inprocess_app import run_in_app

MODELS = ("tiny", "tiny2", "tiny3")
BODY = {"prompt": "the capital", "max_tokens": 2, "ignore_eos": True}


@pytest.fixture
def three_models(store_home, tiny_model_dir):
    from gpuservd.store.store import ModelStore

    for name in MODELS[1:]:
        ModelStore().import_dir(tiny_model_dir, name)
    return store_home


def cache_config(cache_size: int) -> dict:
    return {"engine": {"kv_cache_bytes": "2MiB", "block_size": 4, "num_threads": 1},
            "server": {"models": []}, "cache": {"cache_size": cache_size, "host_bytes": "64MiB"}}


async def ask(client, model: str):
    r = await client.post("/v1/completions", json={**BODY, "model": model})
    assert r.status_code == 200, r.text


def tick(serving) -> None:
    """The daemon's evaluation, which runs on its event loop every second: it reads what the rules need,
    never the whole /admin/status (milliseconds under load, during which a scrape waits)."""
    def whole_status():
        raise AssertionError("the evaluation read the whole status")

    serving.status = whole_status
    try:
        serving.hints.tick(serving)
    finally:
        del serving.status


def cyclic_then_burst(result: dict, rounds: int = 7):
    """Each model in turn `rounds` times (21 requests, one at a time), then 5 requests at once for the
    model that left the device last; result gets the active hints and the events the bus carried."""
    async def check(client, serving):
        events: list[dict] = []
        serving.bus.taps.append(lambda e: events.append(e if isinstance(e, dict) else e.to_json()))
        tick(serving)  # the counters before the traffic
        for _ in range(rounds):
            for m in MODELS:
                await ask(client, m)
        await asyncio.gather(*(ask(client, MODELS[1]) for _ in range(5)))
        tick(serving)
        result["hints"] = {h["name"]: h for h in serving.hints.hints()}
        result["events"] = events
        result["weight_cache"] = serving.status()["weight_cache"]

    return check


def test_a_device_tier_too_small_for_the_traffic_fires_both_cache_rules(three_models):
    got: dict = {}
    run_in_app(cyclic_then_burst(got), cache_config(1))
    wc, hints = got["weight_cache"], got["hints"]
    assert wc["hits"]["device"] + wc["misses"]["device"] == 26 and wc["misses"]["device"] >= 21
    low = hints["cache_hit_rate_low"]["evidence"]
    assert low["tier"] == "device" and low["cache_size"] == 1 and low["threshold"] == 0.9
    assert (low["hits"], low["misses"]) == (wc["hits"]["device"], wc["misses"]["device"])
    assert low["hit_rate"] <= 0.2
    assert low["suggested_cache_size"] == 3 and low["num_models"] == 3 and low["num_requests"] == 26
    assert "raise cache.cache_size to 3" in hints["cache_hit_rate_low"]["action"]
    evicts = [e for e in got["events"] if e["type"] == "model_evict"]
    assert len(evicts) >= 20
    reload = hints["load_after_evict"]["evidence"]
    # the last reload is the burst's: tiny2 evicted for tiny3 a moment before five requests needed it back
    assert reload["model"] == "tiny2" and reload["num_requests"] >= 5 and reload["num_reloads"] >= 1
    assert 0 <= reload["evicted_s_before"] <= reload["threshold_s"] == 60.0
    assert "pin tiny2" in hints["load_after_evict"]["action"]


def test_a_device_tier_that_holds_the_traffic_is_quiet(three_models):
    got: dict = {}
    run_in_app(cyclic_then_burst(got), cache_config(3))
    wc = got["weight_cache"]
    assert wc["misses"]["device"] == 3 and wc["hits"]["device"] == 23  # each model loaded once
    assert not any(e["type"] == "model_evict" for e in got["events"])
    assert "cache_hit_rate_low" not in got["hints"] and "load_after_evict" not in got["hints"]

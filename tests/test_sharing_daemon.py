"""Sharing one device in the daemon: the arbiter between two loaded models, memory quotas on
their KV pools, what /admin/status says on a machine without CUDA, and the config's errors."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from gpuservd.serving.daemon_config import daemon_config_from_dict
from gpuservd.errors import UserError
from inprocess_app import run_in_app

BODY = {"prompt": "the capital", "max_tokens": 12, "ignore_eos": True}


@pytest.fixture()
def two_models(store_home, tiny_model_dir):
    """The tiny model twice in the store: 'tiny' and 'tiny2'."""
    from gpuservd.store.store import ModelStore

    ModelStore().import_dir(tiny_model_dir, "tiny2")
    return store_home


def config(**sharing) -> dict:
    return {"engine": {"kv_cache_bytes": "4MiB", "block_size": 4, "num_threads": 1},
            "server": {"models": ["tiny", "tiny2"]},
            "sharing": {"quantum_ms": 10, "models": {"tiny": {"share": 0.6, "class": "latency_critical"},
                                                     "tiny2": {"share": 0.4, "class": "best_effort"}},
                        **sharing}}


async def load_both(client, n=6):
    jobs = [client.post("/v1/completions", json={**BODY, "model": m}) for m in ("tiny", "tiny2") for _ in range(n)]
    rs = await asyncio.gather(*jobs)
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    assert all(r.json()["usage"]["completion_tokens"] == 12 for r in rs)


def test_two_models_take_turns_under_the_arbiter(two_models):
    events = []

    async def check(client, serving):
        serving.bus.taps.append(events.append)
        await load_both(client)
        st = (await client.get("/admin/status")).json()
        arb = st["arbiter"]
        assert arb["enabled"] and arb["quantum_ms"] == 10
        assert arb["groups"] == [{"name": "device", "models": ["tiny", "tiny2"], "holder": None, "waiting": []}] or \
            arb["groups"][0]["models"] == ["tiny", "tiny2"]
        assert arb["models"]["tiny"]["class"] == "latency_critical" and arb["models"]["tiny2"]["share"] == 0.4
        assert arb["models"]["tiny"]["num_steps"] > 0 and arb["models"]["tiny2"]["num_steps"] > 0
        assert arb["num_switches"] > 0  # both had work at once: the group changed hands
        models = {m["name"]: m for m in st["models"]}
        assert models["tiny"]["sharing_class"] == "latency_critical" and models["tiny"]["sharing_group"] == "device"
        assert models["tiny2"]["num_sms"] is None
        # no CUDA here: nothing pretends to partition SMs
        assert st["partitions"]["summary"] == "SM partitions: not enforced (no CUDA device)"
        assert st["partitions"]["enforced"] is False and st["partitions"]["time_slice_group"] == "device"
        assert st["sharing"]["name"] == "none"
        text = (await client.get("/metrics")).text
        assert 'gpuserv_arbiter_run_seconds_total{model_name="tiny"}' in text
        # its duty is a live AIMD value (a slow step on a loaded machine throttles it): the series is there, in range
        duty = float(re.search(r'^gpuserv_arbiter_duty\{model_name="tiny2"\} (\S+)$', text, re.M).group(1))
        assert 0.05 <= duty <= 1.0
        assert 'gpuserv_memory_quota_bytes{model_name="tiny"}' in text

    run_in_app(check, config(), load=["tiny", "tiny2"])
    slices = [e for e in events if e["type"] == "time_slice"]
    assert slices and all({"run_s", "switch_s", "quantum_ms", "device", "model"} <= set(e) for e in slices)
    assert any(e["next"] for e in slices)


def test_sharing_off_is_naive_co_location(two_models):
    async def check(client, serving):
        await load_both(client, 3)
        st = (await client.get("/admin/status")).json()
        assert st["arbiter"]["enabled"] is False and "sharing.enabled" in st["arbiter"]["reason"]
        assert serving.slots["tiny"].loop.arbiter is None

    run_in_app(check, config(enabled=False), load=["tiny", "tiny2"])


def test_a_memory_quota_caps_the_models_own_kv_and_a_lowered_one_moves_its_requests_out(two_models):
    """Memory quotas: the quota's KV part caps the model's pool; lowering it on a reload makes the model move its own
    requests out (quota preemptions) while the other model's pool is untouched."""
    events = []

    async def check(client, serving):
        serving.bus.taps.append(events.append)
        st = (await client.get("/admin/status")).json()
        q = st["quotas"]["tiny"]
        assert q["need"] == q["weights"] + q["kv_peak"] + q["activations"] + q["overhead"]
        assert q["quota"] == int(q["need"] * 1.2) or abs(q["quota"] - q["need"] * 1.2) <= 1
        assert q["kv_cap_blocks"] is None  # the computed quota holds the whole pool
        eng, other = serving.slots["tiny"].loop.engine, serving.slots["tiny2"].loop.engine
        per_block = eng.runner.cache.shape.bytes_per_block
        cap = 16  # one request (prompt + 40 tokens, 4 per block) fits; four do not

        def quota(blocks):
            new = daemon_config_from_dict(config()).sharing
            new.models["tiny"].memory_quota_bytes = q["weights"] + q["activations"] + q["overhead"] + blocks * per_block
            return new

        applied = []  # the engine threads' futures for what a reconfigure hands them

        def on_engine(model, fn):
            applied.append(serving.slots[model].loop.call(fn))

        # long requests in flight on tiny; the engine is held at a step boundary once they hold twice the new
        # cap, the quota drops (a reload), and the engine goes on: no timing involved
        reached, go = threading.Event(), threading.Event()
        real_step = eng.step

        def gated_step():
            if eng.pool.num_used >= 2 * cap and not go.is_set():
                reached.set()
                go.wait(30)
            return real_step()

        eng.step = gated_step
        jobs = [asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "model": "tiny", "max_tokens": 40}))
                for _ in range(4)]
        assert await asyncio.to_thread(reached.wait, 60)
        assert serving.sharing.reconfigure(quota(cap), on_engine) == []
        go.set()
        rs = await asyncio.gather(*jobs)
        assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40 for r in rs)
        st = (await client.get("/admin/status")).json()
        assert st["quotas"]["tiny"]["kv_cap_blocks"] == cap and st["quotas"]["tiny"]["fixed"] is True
        assert eng.pool.capacity == cap and other.pool.capacity == other.pool.num_blocks
        assert eng.pool.num_used == 0 and other.pool.num_used == 0
        # a quota too small for a request: a clear error naming the setting, and the daemon serves on
        applied.clear()
        serving.sharing.reconfigure(quota(5), on_engine)
        assert applied
        await asyncio.to_thread(lambda: [f.result(60) for f in applied])  # the engine has the new cap
        r = await client.post("/v1/completions", json={**BODY, "model": "tiny", "max_tokens": 40})
        assert r.status_code == 400 and "memory quota allows 5" in r.json()["error"]["message"]
        assert "sharing.models.tiny.memory_quota_bytes" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={**BODY, "model": "tiny", "max_tokens": 4})
        assert r.status_code == 200

    run_in_app(check, config(), load=["tiny", "tiny2"])
    quota = [e for e in events if e["type"] == "preemption" and any(v["reason"] == "quota" for v in e["victims"])]
    assert quota and all(e["model"] == "tiny" for e in quota)
    steps = [e for e in events if e["type"] == "step" and e["model"] == "tiny"]
    assert max(s["kv_blocks_used"] for s in steps[-5:]) <= 16


def test_device_readings_on_a_cpu_say_what_is_unavailable(two_models):
    async def check(client, serving):
        await asyncio.to_thread(serving.sharing.sample)
        r = (await client.get("/admin/status")).json()["device"]["readings"]
        assert r["sm_util_pct"] is None and "no CUDA device" in r["unavailable"]["sm_util_pct"]
        assert r["cpu_util_pct"] is not None and r["host_mem_total_bytes"] > 0

    run_in_app(check, config(), load=["tiny"])


@pytest.mark.parametrize("sharing, message", [
    ({"quantum_ms": 5}, "sharing.quantum_ms must be in [10, 50]"),
    ({"models": {"a": {"clas": "best_effort"}}}, "unknown key sharing.models.a.clas"),
    ({"models": {"a": {"class": "gold"}}}, "sharing.models.a.class 'gold' is unknown"),
    ({"backend": "cuda"}, "sharing.backend 'cuda' is unknown; choose one of: auto, green_context, mps, none"),
    ({"models": {"a": {"share": 0.7}, "b": {"share": 0.5}}}, "the shares add up to 1.20"),
    ({"throttle": {"decrease": 2}}, "sharing.throttle"),
    ({"quantum": 20}, "unknown key sharing.'quantum'"),
])
def test_bad_sharing_config_says_what_to_fix(sharing, message):
    with pytest.raises(UserError) as e:
        daemon_config_from_dict({"sharing": sharing}, "gpuserv.yaml")
    assert message in str(e.value) and str(e.value).startswith("gpuserv.yaml")


def test_green_context_asked_for_on_a_cpu_is_a_clear_error(two_models):
    from gpuservd.serving.serving import Serving
    from gpuservd.serving.tenants import TenantMap

    cfg = daemon_config_from_dict({"sharing": {"backend": "green_context"}})
    with pytest.raises(UserError, match="sharing.backend green_context is not available on cpu"):
        Serving(cfg, TenantMap())

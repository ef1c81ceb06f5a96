"""Cache-aware routing over several devices: the pure chooser, the weight cache's per-device
tiers, the config's checks, and the daemon in-process on two CPU device slots."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gpuservd.config import check_devices
from gpuservd.errors import UserError
from gpuservd.serving.routing import DeviceOption, choose_device
from gpuservd.weights.cache import CacheFull, WeightCache
from gpuservd.weights.config import CacheConfig
from inprocess_app import run_in_app

MB = 1_000_000


# ---- the chooser: one test per rule ----------------------------------------------------------------

def opt(device, index, evict=(), evict_bytes=0, load=0, feasible=True):
    return DeviceOption(device, index, feasible, list(evict), evict_bytes, load)


def test_resident_device_wins_whatever_it_costs():
    options = [opt("cpu:0", 0), opt("cpu:1", 1, ["x"], 10 * MB, load=9)]
    assert choose_device(options, resident="cpu:1").device == "cpu:1"


def test_no_eviction_beats_any_eviction_even_under_load():
    options = [opt("cpu:0", 0, ["x"], 1, load=0), opt("cpu:1", 1, load=50)]
    assert choose_device(options).device == "cpu:1"


def test_fewer_bytes_evicted_wins():
    options = [opt("cpu:0", 0, ["big"], 9 * MB), opt("cpu:1", 1, ["a", "b"], 2 * MB)]
    assert choose_device(options).device == "cpu:1"


def test_same_bytes_fewer_models_evicted_wins():
    options = [opt("cpu:0", 0, ["a", "b"], 4 * MB), opt("cpu:1", 1, ["c"], 4 * MB)]
    assert choose_device(options).device == "cpu:1"


def test_same_eviction_lighter_load_wins():
    options = [opt("cpu:0", 0, load=3), opt("cpu:1", 1, load=1)]
    assert choose_device(options).device == "cpu:1"


def test_full_tie_goes_to_the_lower_index():
    options = [opt("cpu:1", 1), opt("cpu:0", 0)]
    assert choose_device(options).device == "cpu:0"


def test_infeasible_devices_are_skipped_and_none_when_all_are():
    options = [opt("cpu:0", 0, feasible=False), opt("cpu:1", 1, ["a"], MB, load=5)]
    assert choose_device(options).device == "cpu:1"
    assert choose_device([opt("cpu:0", 0, feasible=False)]) is None


# ---- the weight cache's device tiers ---------------------------------------------------------------

def two_devices(cache_size=1, budget=10 * MB):
    return WeightCache(CacheConfig(cache_size=cache_size), budget, ["cpu:0", "cpu:1"])


def test_cache_plans_each_device_alone_and_never_evicts_busy_or_pinned():
    c = two_devices()
    c.device_loaded("a", 4 * MB, device="cpu:0")
    c.device_loaded("b", 4 * MB, device="cpu:1", pinned=True)
    assert c.device_of("a") == "cpu:0" and c.device_of("b") == "cpu:1" and c.device_of("z") is None
    plans = c.plan_options("c", 4 * MB, busy=set())
    assert plans["cpu:0"].evict == ["a"] and plans["cpu:0"].evict_bytes == 4 * MB
    assert isinstance(plans["cpu:1"], CacheFull) and "device cpu:1" in str(plans["cpu:1"])
    assert isinstance(c.plan_options("c", 4 * MB, busy={"a"})["cpu:0"], CacheFull)
    assert c.plan_device_load("c", 4 * MB, set(), device="cpu:0") == ["a"]
    with pytest.raises(UserError, match="device tier holds"):
        c.plan_options("huge", 11 * MB, set())
    st = c.status()["devices"]
    assert st["cpu:0"]["models"] == ["a"] and st["cpu:1"]["used_bytes"] == 4 * MB
    assert c.residency("b")["device_name"] == "cpu:1"
    c.device_evicted("a")
    assert c.device_of("a") is None and c.plan_options("c", 4 * MB, set())["cpu:0"].evict == []


def test_a_load_in_progress_reserves_its_device():
    c = two_devices()
    c.reserve("a", "cpu:0", 4 * MB)
    plans = c.plan_options("b", 4 * MB, set())
    assert isinstance(plans["cpu:0"], CacheFull) and plans["cpu:1"].evict == []
    c.device_loaded("a", 4 * MB, device="cpu:0")
    assert c.reserved == {} and c.device_of("a") == "cpu:0"


def test_single_device_api_is_unchanged():
    c = WeightCache(CacheConfig(cache_size=1), 10 * MB)
    c.device_loaded("a", 4 * MB)
    assert c.plan_device_load("b", 4 * MB, set()) == ["a"]
    assert c.status()["device"]["models"] == ["a"]


# ---- configuration ---------------------------------------------------------------------------------

@pytest.mark.parametrize("devices,message", [
    (["cpu:0", "cpu:0"], "engine.devices lists 'cpu:0' twice"),
    (["cpu", "cpu:0"], "are the same device"),
    (["cpu:0", "cuda:0"], "mixes cpu and cuda"),
    (["gpu:0"], "unknown device 'gpu:0'"),
    ("cpu:0", "must be a list"),
    (["cuda:7"], "cuda:7 is not there"),
])
def test_bad_devices_are_one_line_errors_naming_the_setting(devices, message):
    from gpuservd.serving.daemon_config import daemon_config_from_dict

    with pytest.raises(UserError) as e:
        daemon_config_from_dict({"engine": {"devices": devices}})
    assert message in str(e.value) and "engine.devices" in str(e.value) and "\n" not in str(e.value)


def test_devices_default_to_the_one_device():
    from gpuservd.serving.daemon_config import daemon_config_from_dict

    assert daemon_config_from_dict({}).engine.device_names() == ["cpu"]
    assert daemon_config_from_dict({"engine": {"devices": ["cpu:0", "cpu:1"]}}).engine.device_names() == \
        ["cpu:0", "cpu:1"]
    assert check_devices(["cuda:0", "cuda:1"], visible_cuda=2) == ["cuda:0", "cuda:1"]


# ---- the daemon on two CPU device slots --------------------------------------------------------------

def body(model, max_tokens=3):
    return {"model": model, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True}


@pytest.fixture()
def three_models(store_home, tiny_model_dir):
    """a, b, c: the tiny model under three names; returns the bytes one takes on the device."""
    import torch

    from gpuservd.runner.load import SafetensorsReader, expected_bytes
    from gpuservd.store.store import ModelStore

    store = ModelStore()
    for name in ("a", "b", "c"):
        store.import_dir(tiny_model_dir, name)
    return expected_bytes(SafetensorsReader(store.path("a")), torch.float32)


def two_slot_config(weight_bytes):
    """Two CPU device slots, each with room for one tiny model's weights (not two)."""
    # fp32 pinned: the three_models fixture sizes the slots for fp32 weights (auto is bf16 on an AVX512_BF16 CPU)
    return {"engine": {"devices": ["cpu:0", "cpu:1"], "device_memory_bytes": int(weight_bytes * 1.5),
                       "kv_cache_bytes": "4MiB", "block_size": 4, "num_threads": 1, "dtype": "float32"},
            "cache": {"cache_size": 4, "host_bytes": 0},
            "sharing": {"quantum_ms": 10},
            "server": {"models": []}}


async def settled(serving, timeout=30.0):
    """Every model's KV blocks back in its pool and nothing in flight (the engine's snapshot lags a step)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while any(s.loop.snapshot.kv_blocks_used or s.num_in_flight for s in serving.slots.values()):
        assert asyncio.get_running_loop().time() < deadline, {
            n: (s.loop.snapshot.kv_blocks_used, s.num_in_flight) for n, s in serving.slots.items()}
        await asyncio.sleep(0.05)


def engine_threads():
    return {t.name for t in threading.enumerate() if t.name.startswith("engine-")}


def test_requests_route_to_the_device_that_holds_their_model(three_models):
    events: list[dict] = []

    async def check(client, serving):
        serving.bus.taps.append(events.append)

        def loads(model):
            return [e for e in events if e["type"] == "model_load" and e["phase"] == "ready" and e["model"] == model]

        assert (await client.post("/v1/completions", json=body("a"))).status_code == 200
        assert serving.slots["a"].device == "cpu:0"  # both empty: the lower index
        assert (await client.post("/v1/completions", json=body("b"))).status_code == 200
        assert serving.slots["b"].device == "cpu:1"  # cpu:0 would have to evict a; cpu:1 need not
        assert not [e for e in events if e["type"] == "model_evict"]
        assert (await client.post("/v1/completions", json=body("a"))).status_code == 200
        assert len(loads("a")) == 1 and serving.slots["a"].device == "cpu:0"  # a hit: no second load
        assert serving.cache.hits["device"] >= 1

        st = (await client.get("/admin/status")).json()
        devices = {m["name"]: m["device"] for m in st["models"]}
        assert devices == {"a": "cpu:0", "b": "cpu:1"}
        assert st["devices"]["cpu:0"]["models"] == ["a"] and st["devices"]["cpu:1"]["models"] == ["b"]
        assert st["devices"]["cpu:1"]["used_bytes"] == three_models
        assert st["devices"]["cpu:0"]["budget_bytes"] == int(three_models * 1.5)
        assert {m["name"]: m["sharing_group"] for m in st["models"]} == {"a": "cpu:0", "b": "cpu:1"}
        assert {m["name"]: m["tiers"]["device_name"] for m in st["models"]} == {"a": "cpu:0", "b": "cpu:1"}

        # b busy (its engine holds its step until the gate opens), a idle: c takes a's place on cpu:0
        engine = serving.slots["b"].loop.engine
        real_step = engine.step
        gate = threading.Event()

        def gated_step():
            gate.wait(60)
            return real_step()

        engine.step = gated_step
        try:
            busy = asyncio.ensure_future(client.post("/v1/completions", json=body("b", 5)))
            while serving.slots["b"].num_in_flight == 0:
                await asyncio.sleep(0.01)
            st = (await client.get("/admin/status")).json()
            assert st["devices"]["cpu:1"]["load"] == 1 and st["devices"]["cpu:0"]["load"] == 0
            r = await client.post("/v1/completions", json=body("c"))
            assert r.status_code == 200
            assert serving.slots["b"].num_in_flight == 1, "b's request ended before c was routed"
            assert serving.slots["c"].device == "cpu:0" and "a" not in serving.slots
            evicts = [e for e in events if e["type"] == "model_evict"]
            assert [(e["model"], e["device"], e["for"]) for e in evicts] == [("a", "cpu:0", "c")]
            assert loads("c")[0]["device"] == "cpu:0" and loads("b")[0]["device"] == "cpu:1"
        finally:
            gate.set()  # never leave b's engine thread waiting
        assert (await busy).status_code == 200
        engine.step = real_step
        assert "engine-a" not in engine_threads()  # the evicted model's engine thread ended
        await settled(serving)

    before = engine_threads()
    run_in_app(check, two_slot_config(three_models))
    assert engine_threads() <= before


def test_two_cold_requests_at_once_go_to_different_devices(three_models):
    async def check(client, serving):
        ra, rb = await asyncio.gather(client.post("/v1/completions", json=body("a")),
                                      client.post("/v1/completions", json=body("b")))
        assert ra.status_code == rb.status_code == 200
        assert {serving.slots["a"].device, serving.slots["b"].device} == {"cpu:0", "cpu:1"}
        assert serving.cache.reserved == {}
        await settled(serving)

    before = engine_threads()
    run_in_app(check, two_slot_config(three_models))
    assert engine_threads() <= before


def test_no_device_can_make_room_fails_only_that_model(three_models):
    async def check(client, serving):
        await serving.load("a", pinned=True)
        await serving.load("b", pinned=True)
        assert {serving.slots["a"].device, serving.slots["b"].device} == {"cpu:0", "cpu:1"}
        r = await client.post("/v1/completions", json=body("c"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "device_full"  # full for now, not broken
        msg = r.json()["error"]["message"]
        assert "no room on device cpu:0" in msg and "no room on device cpu:1" in msg
        assert (await client.post("/v1/completions", json=body("a"))).status_code == 200

    run_in_app(check, two_slot_config(three_models))


def test_a_variant_goes_where_its_base_is_even_when_another_device_is_free(three_models, store_home):
    from test_variants import derive

    derive(store_home, "tiny-lora")
    config = two_slot_config(three_models)
    config["engine"]["device_memory_bytes"] = three_models * 3
    config["cache"]["cache_size"] = 2

    async def check(client, serving):
        for model in ("a", "tiny"):  # both fit cpu:0 without eviction: the lower index takes both
            assert (await client.post("/v1/completions", json=body(model))).status_code == 200
        assert serving.slots["a"].device == serving.slots["tiny"].device == "cpu:0"
        # cpu:1 is empty, but the variant's base is on cpu:0: it goes there and a (idle, older) leaves
        assert (await client.post("/v1/completions", json=body("tiny-lora"))).status_code == 200
        assert serving.slots["tiny-lora"].device == "cpu:0" and serving.slots["tiny-lora"].source_tier == "delta"
        assert "a" not in serving.slots and serving.cache.status()["devices"]["cpu:1"]["models"] == []
        assert (await client.post("/v1/completions", json=body("a"))).status_code == 200
        assert serving.slots["a"].device == "cpu:1"  # cpu:0 is full now; cpu:1 takes it without eviction

    run_in_app(check, config)


def test_the_sharing_plan_is_per_device(three_models):
    """Quotas are checked against each device's memory, not every model's against one device's."""
    config = two_slot_config(three_models)
    config["engine"]["device_memory_bytes"] = 3 * three_models + 12 * 2**20  # one model's quota, not two
    config["engine"]["kv_cache_bytes"] = "2MiB"
    config["cache"]["cache_size"] = 1

    async def check(client, serving):
        for model in ("a", "b"):
            await serving.load(model)  # cache_size 1: the second goes to cpu:1
        st = (await client.get("/admin/status")).json()
        assert {m["name"]: m["device"] for m in st["models"]} == {"a": "cpu:0", "b": "cpu:1"}
        part = st["partitions"]
        assert part["error"] is None and set(st["quotas"]) == {"a", "b"}
        assert not [w for w in part["warnings"] if "add up" in w], part["warnings"]
        assert [w for w in serving.sharing._plan_for(["a", "b"]).warnings if "add up" in w]  # one device's view
        assert part["time_slice_group"] == "cpu:0, cpu:1"
        assert st["arbiter"]["enabled"]

    run_in_app(check, config)


def test_the_daemon_starts_models_across_devices_and_a_new_device_list_needs_a_restart(tmp_path, tiny_model_dir):
    from daemon_harness import DaemonProcess, make_home

    home = make_home(tmp_path, tiny_model_dir, names=("a", "b"))
    config = {"engine": {"devices": ["cpu:0", "cpu:1"]}, "cache": {"cache_size": 1},
              "server": {"models": ["a", "b"]}}
    d = DaemonProcess(tmp_path, home, config=config)
    try:
        d.wait_ready()
        st = d.status()
        assert sorted(m["device"] for m in st["models"]) == ["cpu:0", "cpu:1"]
        assert sorted(st["devices"]) == ["cpu:0", "cpu:1"]
        assert all(len(v["models"]) == 1 for v in st["devices"].values())
        from typer.testing import CliRunner

        from gpuservd.cli.main import app as cli

        out = CliRunner().invoke(cli, ["status", "--socket", str(d.socket)]).output
        line = next(x for x in out.splitlines() if x.startswith("devices: "))
        assert "cpu:0 " in line and "cpu:1 " in line and "load 0" in line, out
        d.write_config({**config, "engine": {"devices": ["cpu:0"]}})
        with d.http() as c:
            r = c.post("/admin/reload")
            assert r.status_code == 200 and "engine.devices" in r.json()["needs_restart"], r.text
            for name in ("a", "b"):
                ok = c.post("/v1/completions", json=body(name))
                assert ok.status_code == 200, ok.text
        assert sorted(d.status()["devices"]) == ["cpu:0", "cpu:1"]  # the running devices stay until a restart
    finally:
        d.stop(wait_exit=False)

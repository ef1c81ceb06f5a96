"""The weight cache through the real daemon: load on demand, LRU eviction to the host tier,
reload from the host tier, layered INT8 loads, and load failures that hurt only their model."""

from __future__ import annotations

import threading

import pytest

from daemon_harness import DaemonProcess, make_home, wait_until

COMP = "/v1/completions"


def ask(d, model, max_tokens=3, timeout=60):
    body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True}
    with d.http(timeout=timeout) as c:
        return c.post(COMP, json=body)


def model(d, name):
    return next((m for m in d.status()["models"] if m["name"] == name), None)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("daemon-weights")
    home = make_home(tmp, tiny_model_dir, names=("tiny", "tiny2", "tiny3", "broken", "gone"))
    store = home / "models"
    shard = next((store / "broken").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a truncated shard
    next((store / "gone").glob("*.safetensors")).unlink()  # a missing file
    d = DaemonProcess(tmp, home, config={
        "server": {"models": ["tiny"]},
        "cache": {"cache_size": 2, "host_bytes": "64MiB", "load_strategy": "layered", "initial_layers": 1,
                  "compression": "int8", "int8_min_agreement": 0},  # tiering, not quality: no check
    })
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop(wait_exit=False)


def test_on_demand_load_then_lru_eviction_to_host_and_back(daemon):
    assert ask(daemon, "tiny").status_code == 200
    st = daemon.status()["weight_cache"]
    assert (st["hits"]["device"], st["misses"]["device"]) == (1, 0)  # tiny was loaded at start: a hit
    t = model(daemon, "tiny")
    assert t["source_tier"] == "disk-int8" and t["layers_ready"] == t["num_layers"] == 3
    # Two requests for a model that is not loaded: one load, both served.
    results = []
    threads = [threading.Thread(target=lambda: results.append(ask(daemon, "tiny2"))) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert [r.status_code for r in results] == [200, 200]
    wait_until(lambda: daemon.status()["weight_cache"]["host"]["models"].count("tiny") == 1, 30,
               what="tiny's host copy")
    assert ask(daemon, "tiny3").status_code == 200  # cache_size 2: the least recently used (tiny) leaves
    names = {m["name"] for m in daemon.status()["models"]}
    assert names == {"tiny2", "tiny3"}
    st = daemon.status()["weight_cache"]
    assert "tiny" in st["host"]["models"] and st["host"]["compression"] == "int8"
    assert ask(daemon, "tiny").status_code == 200  # back from the host tier, not the disk
    assert model(daemon, "tiny")["source_tier"] == "host"
    assert model(daemon, "tiny")["tiers"]["host"] > 0
    st = daemon.status()["weight_cache"]
    # one host hit (tiny coming back); five device lookups, one per request: tiny's first (a hit), tiny3 and
    # tiny's return (misses), and tiny2's two, which miss unless the second arrived after the load was done
    assert st["hits"]["host"] == 1 and st["hits"]["device"] + st["misses"]["device"] == 5
    assert 3 <= st["misses"]["device"] <= 4
    log = daemon.log
    assert log.count("model tiny2 ready") == 1  # one load for the two concurrent requests
    assert "evicting model tiny from the device to make room for tiny3" in log


@pytest.mark.parametrize("name,reason", [("broken", "broken"), ("gone", "gone")])
def test_failed_load_fails_only_its_requests(daemon, name, reason):
    r = ask(daemon, name)
    assert r.status_code == 404
    msg = r.json()["error"]["message"]
    assert f"{name} failed to load" in msg and ("safetensors" in msg or "weight" in msg)
    assert model(daemon, name)["state"] == "failed"
    assert ask(daemon, "tiny2").status_code == 200  # the others keep serving
    for m in daemon.status()["models"]:
        if m["state"] == "ready":
            assert m["kv_blocks_free"] == m["kv_blocks_total"]


def test_model_too_big_for_the_device_tier(tmp_path, tiny_model_dir):
    home = make_home(tmp_path, tiny_model_dir)
    d = DaemonProcess(tmp_path, home, config={"server": {"models": []}, "cache": {"device_bytes": 1000}})
    try:
        d.wait_ready()
        r = ask(d, "tiny")
        assert r.status_code == 404
        assert "needs" in r.json()["error"]["message"] and "device tier holds 0.0 MB" in r.json()["error"]["message"]
    finally:
        d.stop(wait_exit=False)


def test_prefetch_warms_the_model_that_usually_follows(tmp_path, tiny_model_dir):
    home = make_home(tmp_path, tiny_model_dir, names=("a", "b", "c"))
    d = DaemonProcess(tmp_path, home, config={"server": {"models": []},
                                              "cache": {"cache_size": 2, "prefetch": True, "host_bytes": 0}})
    try:
        d.wait_ready()
        for name in ["a", "b", "a", "b", "c", "a"]:  # learns a -> b; b ends up evicted
            assert ask(d, name).status_code == 200
        assert {m["name"] for m in d.status()["models"]} == {"a", "c"}
        assert ask(d, "a").status_code == 200  # b follows a: warmed without being asked for, c leaves
        wait_until(lambda: (model(d, "b") or {}).get("state") == "ready", 30, what="b prefetched")
        pf = d.status()["weight_cache"]["prefetch"]
        assert pf["enabled"] and pf["issued"] >= 1
        assert ask(d, "b").status_code == 200
        pf = d.status()["weight_cache"]["prefetch"]
        assert pf["used"] >= 1 and pf["accuracy"] > 0
        assert "prefetching model b (follows a" in d.log
    finally:
        d.stop(wait_exit=False)


def test_versions_split_traffic_and_change_at_run_time(tmp_path, tiny_model_dir):
    home = make_home(tmp_path, tiny_model_dir, names=("tiny", "tiny-canary"))
    d = DaemonProcess(tmp_path, home, config={
        "server": {"models": ["tiny", "tiny-canary"], "versions": {"tiny": {"tiny": 1, "tiny-canary": 1}}},
        "cache": {"hit_rate_alert": 0.99}})
    try:
        d.wait_ready()
        served = [ask(d, "tiny", max_tokens=1).json()["model"] for _ in range(40)]
        assert set(served) == {"tiny", "tiny-canary"}  # the response names the version that served it
        st = d.status()["versions"]["tiny"]
        assert sum(st["served"].values()) == 40 and st["weights"] == {"tiny": 1.0, "tiny-canary": 1.0}
        from typer.testing import CliRunner

        from gpuservd.cli.main import app

        env = {"GPUSERV_SOCKET": str(d.socket), "GPUSERV_HOME": str(home)}
        r = CliRunner().invoke(app, ["models", "versions", "tiny", "tiny-canary=100", "tiny=0"], env=env)
        assert r.exit_code == 0 and "tiny-canary 100%" in r.output, r.output
        assert {ask(d, "tiny", max_tokens=1).json()["model"] for _ in range(10)} == {"tiny-canary"}
        with d.http() as c:
            bad = c.post("/admin/models/tiny/versions", json={"weights": {"tiny": -1}})
        assert bad.status_code == 400 and "must be a number >= 0" in bad.json()["error"]["message"]
        r = CliRunner().invoke(app, ["models", "versions", "tiny", "--clear"], env=env)
        assert r.exit_code == 0 and ask(d, "tiny", max_tokens=1).json()["model"] == "tiny"
        with d.http() as c:
            text = c.get("/metrics").text
        assert 'gpuserv_weight_cache_hits_total{tier="device"}' in text
    finally:
        d.stop(wait_exit=False)


def test_low_hit_rate_publishes_a_sizing_suggestion(tmp_path, tiny_model_dir):
    home = make_home(tmp_path, tiny_model_dir, names=("a", "b", "c"))
    d = DaemonProcess(tmp_path, home, config={"server": {"models": []},
                                              "cache": {"cache_size": 1, "host_bytes": "64MiB",
                                                        "hit_rate_window": 6}})
    try:
        d.wait_ready()
        for i in range(7):  # round robin over 3 models with room for 1: every request misses (each one a load)
            assert ask(d, "abc"[i % 3], max_tokens=1).status_code == 200
        with d.http() as c, c.stream("GET", "/admin/events", params={"recent": "50",
                                                                    "types": "cache_hit_rate_low"}) as r:
            import json

            lines = r.iter_lines()
            json.loads(next(lines))  # hello
            ev = json.loads(next(lines))
        assert ev["hit_rate"] < 0.9 and ev["models_for_90pct"] == 3 and ev["suggested_cache_size"] == 3
        assert ev["window"] == 6 and "over the last 6 requests" in ev["message"]
        assert "raise cache_size to 3" in ev["message"]
    finally:
        d.stop(wait_exit=False)

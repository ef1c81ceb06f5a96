"""Ollama's keep_alive through the real daemon: an idle model leaves the device by itself after
cache.keep_alive_s (down to the host tier, with a model_unload event saying why), a request's
keep_alive overrides it for its model (-1 forever, 0 right after the request), and a pinned model never
leaves. One daemon; each test uses its own model."""

from __future__ import annotations

import json
import threading
import time

import pytest

from daemon_harness import DaemonProcess, make_home, wait_until

KEEP = 1.5  # cache.keep_alive_s


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("keep-alive")
    home = make_home(tmp, tiny_model_dir, names=("tiny", "tiny2", "tiny3", "tiny4"))
    d = DaemonProcess(tmp, home, config={"server": {"models": []},
                                         "cache": {"keep_alive_s": KEEP, "cache_size": 4, "host_bytes": "64MiB"}})
    d.unloads: list[dict] = []

    def read():
        with d.http(timeout=None) as c, c.stream("GET", "/admin/events", params={"types": "model_unload"}) as r:
            for line in r.iter_lines():
                e = json.loads(line)
                if e.get("type") == "model_unload":  # the stream starts with a hello
                    d.unloads.append(e)

    try:
        d.wait_ready(600)
        threading.Thread(target=read, daemon=True).start()
        yield d
    finally:
        d.stop(wait_exit=False)


def ask(d, model, **extra):
    with d.http(timeout=120) as c:
        r = c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    return time.monotonic()


def model(d, name):
    return next((m for m in d.status()["models"] if m["name"] == name), None)


def test_an_idle_model_leaves_after_keep_alive_s_by_itself(daemon):
    done = ask(daemon, "tiny")
    m = model(daemon, "tiny")
    assert m["keep_alive_s"] == KEEP and m["unload_in_s"] is not None and m["unload_in_s"] <= KEEP
    wait_until(lambda: model(daemon, "tiny") is None, 60, what="tiny to leave the device")
    assert time.monotonic() - done >= KEEP  # not before its keep_alive
    wait_until(lambda: any(e["model"] == "tiny" for e in daemon.unloads), 10, what="the unload event")
    ev = next(e for e in daemon.unloads if e["model"] == "tiny")
    assert ev["reason"] == "keep_alive" and ev["num_aborted"] == 0
    st = daemon.status()["weight_cache"]
    assert "tiny" in st["host"]["models"]  # down a tier, not gone
    assert f"model tiny idle for" in daemon.log and "unloading it" in daemon.log


def outlive_a_witness(d) -> None:
    """Until a model asked for after the one under test, with the default keep_alive, has left the device:
    the keep-alive timer has since passed the default deadline of the one under test too."""
    before = sum(e["model"] == "tiny" for e in d.unloads)
    ask(d, "tiny")
    wait_until(lambda: sum(e["model"] == "tiny" for e in d.unloads) > before, 60, what="the witness to leave")


def test_a_requests_keep_alive_minus_one_keeps_it_forever(daemon):
    ask(daemon, "tiny2", keep_alive=-1)
    outlive_a_witness(daemon)
    m = model(daemon, "tiny2")
    assert m is not None and m["keep_alive_s"] == -1 and m["unload_in_s"] is None


def test_a_requests_keep_alive_zero_unloads_right_after_it(daemon):
    ask(daemon, "tiny3", keep_alive="0s")
    wait_until(lambda: model(daemon, "tiny3") is None, 30, what="tiny3 to leave at once")
    wait_until(lambda: any(e["model"] == "tiny3" for e in daemon.unloads), 10, what="the unload event")
    ev = next(e for e in daemon.unloads if e["model"] == "tiny3")
    assert ev["reason"] == "keep_alive"
    # and a duration string sets seconds: "1m" keeps the next load for a minute
    ask(daemon, "tiny3", keep_alive="1m")
    m = model(daemon, "tiny3")
    assert m["keep_alive_s"] == 60 and m["unload_in_s"] > 50


def test_a_pinned_model_never_leaves(daemon):
    ask(daemon, "tiny4")
    with daemon.http() as c:
        assert c.post("/admin/models/tiny4/pin", json={"pinned": True}).status_code == 200
    ask(daemon, "tiny4", keep_alive=0)
    outlive_a_witness(daemon)
    m = model(daemon, "tiny4")
    assert m is not None and m["pinned"] and m["unload_in_s"] is None


def test_a_bad_keep_alive_is_a_400_naming_the_field(daemon):
    with daemon.http() as c:
        r = c.post("/v1/completions", json={"model": "tiny4", "prompt": "hi", "max_tokens": 2, "keep_alive": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "keep_alive"
    assert "a duration like" in r.json()["error"]["message"]


# ---- the eviction guard: a device of one model, and a second model asked for -------------------------------

@pytest.fixture(scope="module")
def full(tmp_path_factory, tiny_model_dir):
    """A daemon whose device tier holds one model, with no keep_alive of its own (cache.keep_alive_s -1)."""
    tmp = tmp_path_factory.mktemp("keep-alive-full")
    home = make_home(tmp, tiny_model_dir, names=("one", "two"))
    d = DaemonProcess(tmp, home, config={"server": {"models": []}, "cache": {"cache_size": 1, "host_bytes": "64MiB"}})
    try:
        d.wait_ready(600)
        yield d
    finally:
        d.stop(wait_exit=False)


def test_a_requests_keep_alive_holds_its_model_against_eviction(full):
    ask(full, "one", keep_alive="30s")
    with full.http(timeout=120) as c:
        r = c.post("/v1/completions", json={"model": "two", "prompt": "hi", "max_tokens": 2})
    # the device is full for as long as one's keep_alive lasts: a 503 that says when to come back, not a 404
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "device_full" and "one are pinned, busy or kept alive" in err["message"]
    assert 20 <= int(r.headers["Retry-After"]) <= 30
    assert model(full, "one") is not None and model(full, "two") is None
    assert "evicting model one" not in full.log
    # a shorter keep_alive on one's next request: once it runs out one leaves by itself and two loads
    ask(full, "one", keep_alive=1)
    wait_until(lambda: model(full, "one") is None, 30, what="one to leave after its 1 s keep_alive")
    ask(full, "two")
    assert model(full, "two") is not None


def test_keep_alive_forever_stops_the_timer_but_not_eviction(full):
    # -1 means "do not unload me when idle", not a pin: as in Ollama, the model still makes room when another
    # needs the device; only an operator's pin holds a model against that
    ask(full, "one", keep_alive=-1)
    ask(full, "two", keep_alive=-1)
    assert model(full, "two") is not None and model(full, "one") is None
    assert "evicting model one from the device to make room for two" in full.log

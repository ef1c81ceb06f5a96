"""Preemption through the real daemon: a short request displaces a long one (swap), the event
stream, /admin/status and /metrics say so, and tenants.yaml's engine quotas are accepted."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from daemon_harness import DaemonProcess, make_home, wait_until

COMP = "/v1/completions"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("daemon-preempt")
    home = make_home(tmp, tiny_model_dir)
    (tmp / "tenants.yaml").write_text(
        "default: {priority: 0}\n"
        "tenants:\n"
        "  - {name: batch, users: [], priority: 0, weight: 0.5, max_running_seqs: 1, max_kv_blocks: 400}\n")
    d = DaemonProcess(tmp, home, config={
        "scheduler": {"max_num_seqs": 1},
        "preemption": {"mode": "on", "kind": "swap", "min_exec_s": 0, "swap_space_bytes": "8MiB"},
        "server": {"tenants_file": str(tmp / "tenants.yaml")},
    })
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop(wait_exit=False)


def test_short_request_displaces_long_one_and_everyone_finishes(daemon):
    events: list[dict] = []
    stop = threading.Event()

    def read_events():
        with daemon.http(timeout=60) as c, c.stream("GET", "/admin/events",
                                                     params={"types": "preemption,swap"}) as r:
            for line in r.iter_lines():
                events.append(json.loads(line))
                if stop.is_set() or len([e for e in events if e["type"] == "swap"]) >= 2:
                    return

    reader = threading.Thread(target=read_events, daemon=True)
    reader.start()
    results = {}

    def send(name, max_tokens):
        body = {"model": "tiny", "prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True}
        with daemon.http(timeout=120) as c:
            results[name] = c.post(COMP, json=body).json()

    long = threading.Thread(target=send, args=("long", 400))
    long.start()
    wait_until(lambda: daemon.status()["models"][0]["num_running"] == 1, 30, what="long request running")
    send("short", 4)  # 100x shorter: it takes the only batch slot
    assert results["short"]["choices"][0]["finish_reason"] == "length"
    assert "long" not in results  # the short one finished first
    long.join(120)
    assert results["long"]["usage"]["completion_tokens"] == 400
    reader.join(30)
    stop.set()
    pre = [e for e in events if e["type"] == "preemption"]
    assert pre and pre[0]["victims"][0]["kind"] == "swap" and pre[0]["victims"][0]["reason"] == "displaced"
    swaps = {e["kind"] for e in events if e["type"] == "swap"}
    assert swaps == {"swap_out", "swap_in"}
    st = daemon.status()["models"][0]
    assert st["preemption"]["mode"] == "on" and st["preemption"]["host_blocks_used"] == 0
    assert st["preemption"]["costs"]["host_bandwidth"] > 0  # measured, not assumed
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    assert st["preemption"]["num_pinned"] == 0 and st["preemption"]["kv_blocks_reserved"] == 0  # all finished
    with daemon.http() as c:
        text = c.get("/metrics").text
    assert 'gpuserv_kv_blocks{model_name="tiny",state="reserved"} 0.0' in text
    assert 'gpuserv_preemptions_total{kind="swap",model_name="tiny",reason="displaced"}' in text
    out_bytes = [line for line in text.splitlines()
                 if line.startswith('gpuserv_kv_swap_bytes_total{direction="out"')]
    assert out_bytes and float(out_bytes[0].rsplit(" ", 1)[1]) > 0


def test_bad_tenant_quota_is_a_clear_error(tmp_path, tiny_model_dir):
    from gpuservd.errors import UserError
    from gpuservd.serving.tenants import TenantMap

    p = tmp_path / "tenants.yaml"
    p.write_text("tenants:\n  - {name: x, weight: 0}\n")
    with pytest.raises(UserError, match="weight must be a number > 0"):
        TenantMap.load(p)
    p.write_text("tenants:\n  - {name: x, max_kv_blocks: -1}\n")
    with pytest.raises(UserError, match="max_kv_blocks must be >= 0"):
        TenantMap.load(p)

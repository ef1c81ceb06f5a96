"""Engine worker processes through the real daemon (a subprocess on a Unix socket): `engine.isolation:
process` serves the same greedy tokens as engine threads (streaming and not), cancels across the process
boundary and frees the worker's KV, reports the worker's steps in status, events and /metrics, survives
a worker killed with SIGKILL (only its requests fail, with a 503 naming the model; the model is failed
with the signal; the other model serves; the next request starts a fresh worker), and leaves no process
behind after an unload or a stop.

One daemon serves the module: it starts with engine threads (the reference tokens), is reloaded with
`engine.isolation: process`, and its two models are unloaded and loaded again, each into a worker.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from daemon_harness import DaemonProcess, make_home, wait_until

COMP = "/v1/completions"
PROMPTS = ["the capital", "a quick brown fox", "one two three four five"]
MAX_TOKENS = 12


def greedy(http, prompt: str, model: str = "tiny", stream: bool = False) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0,
            "return_token_ids": True, "stream": stream}
    if not stream:
        r = http.post(COMP, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    ids: list[int] = []
    with http.stream("POST", COMP, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
    return ids


def read_events(http, kind: str, recent: int, count: int) -> list[dict]:
    """The first `count` events of type `kind` from /admin/events, replaying the last `recent` first."""
    found = []
    with http.stream("GET", "/admin/events", params={"recent": str(recent), "types": kind}) as r:
        for line in r.iter_lines():
            event = json.loads(line)
            if event["type"] == kind:
                found.append(event)
            if len(found) >= count:
                break
    return found


def models(daemon) -> dict:
    return {m["name"]: m for m in daemon.status()["models"]}


def ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def gone(pid: int) -> bool:
    """No such process, not even a zombie waiting to be reaped."""
    return not Path(f"/proc/{pid}").exists()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("workers")
    home = make_home(tmp, tiny_model_dir, names=("tiny", "tiny2"))
    d = DaemonProcess(tmp, home, config={"server": {"models": ["tiny", "tiny2"]}, "scheduler": {"max_num_seqs": 8}})
    try:
        d.wait_ready()
        with d.http() as http:
            assert {m["isolation"] for m in models(d).values()} == {"thread"}
            d.refs = {(p, s): greedy(http, p, stream=s) for p in PROMPTS for s in (False, True)}
            d.write_config({"server": {"models": ["tiny", "tiny2"]}, "scheduler": {"max_num_seqs": 8},
                            "engine": {"isolation": "process"}})
            assert http.post("/admin/reload").json()["engine_changed"] is True
            for name in ("tiny", "tiny2"):  # engine settings apply at the next load: into a worker
                assert http.post(f"/admin/models/{name}/unload").status_code == 200
                r = http.post(f"/admin/models/{name}/load")
                assert r.status_code == 200, r.text
                assert r.json()["isolation"] == "process" and r.json()["worker_pid"]
        yield d
    finally:
        d.stop(wait_exit=False)


@pytest.fixture()
def http(daemon):
    with daemon.http() as c:
        yield c


def test_gpuserv_status_names_each_workers_pid(daemon):
    from typer.testing import CliRunner

    from gpuservd.cli.main import app as cli

    out = CliRunner().invoke(cli, ["status", "--socket", str(daemon.socket)]).output
    assert "worker" in out.splitlines()[next(i for i, x in enumerate(out.splitlines()) if x.lstrip().startswith("model"))]
    for name, m in models(daemon).items():
        row = next(x for x in out.splitlines() if x.split() and x.split()[0] == name)
        assert row.split()[-1] == str(m["worker_pid"]), out


def test_cpu_workers_without_num_threads_are_warned_about(daemon, caplog):
    """Workers run side by side (no arbiter), each with every core unless engine.num_threads is set: a second
    such worker on the same CPU is a warning with the fix. (This daemon sets num_threads: 1, so no warning.)"""
    from types import SimpleNamespace as NS

    from gpuservd.serving.model_workers import warn_cpu_oversubscription

    assert "oversubscribe" not in daemon.log

    def slot(name, threads=None, pid=None, device="cpu"):
        return NS(name=name, device=device, config=NS(num_threads=threads), loop=NS(pid=pid) if pid else None)

    def warned(new, *others):
        caplog.clear()
        warn_cpu_oversubscription([new, *others], new)
        return [r.getMessage() for r in caplog.records if "oversubscribe" in r.getMessage()]

    msgs = warned(slot("b"), slot("a", pid=11))
    assert len(msgs) == 1 and "models a, b" in msgs[0] and "engine.num_threads (e.g." in msgs[0]
    assert not warned(slot("b"), slot("a", pid=11, threads=1))  # the other has its own thread count
    assert not warned(slot("b", threads=2), slot("a", pid=11))
    assert not warned(slot("b"), slot("a"))  # the other runs on an engine thread (paced by the arbiter)
    assert not warned(slot("b", device="cuda:0"), slot("a", pid=11, device="cuda:0"))


def test_a_worker_serves_the_same_greedy_tokens_as_an_engine_thread(daemon, http):
    for (prompt, stream), ref in daemon.refs.items():
        assert len(ref) == MAX_TOKENS
        assert greedy(http, prompt, stream=stream) == ref, (prompt, stream)
    ms = models(daemon)
    for name in ("tiny", "tiny2"):
        pid = ms[name]["worker_pid"]
        assert ms[name]["isolation"] == "process" and ms[name]["state"] == "ready"
        assert ppid(pid) == daemon.proc.pid  # a child of the daemon
        assert b"gpuservd.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert ms["tiny"]["worker_pid"] != ms["tiny2"]["worker_pid"]
    # the arbiter says plainly that it does not pace them
    assert set(daemon.status()["arbiter"]["not_time_sliced"]) == {"tiny", "tiny2"}


def test_cancel_crosses_the_boundary_and_frees_the_workers_kv(daemon, http):
    total = models(daemon)["tiny"]["kv_blocks_total"]
    body = {"model": "tiny", "prompt": "the capital", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with daemon.http() as c, c.stream("POST", COMP, json=body) as r:
        rid = r.headers["x-request-id"]
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        # the engine's own view of the request, asked of the worker (a named call across the pipe)
        row = next(q for q in http.get("/admin/requests").json()["requests"] if q["request_id"] == rid)
        assert row["state"] == "running" and row["num_output_tokens"] >= 1
        assert models(daemon)["tiny"]["kv_blocks_free"] < total
        assert http.post(f"/admin/requests/{rid}/cancel").json() == {"request_id": rid, "cancelled": True}
        data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["choices"][0]["finish_reason"] == "abort"
    st = wait_until(lambda: (m := models(daemon)["tiny"])["kv_blocks_free"] == total and m, 15, what="KV back")
    assert st["num_running"] == 0 and st["num_waiting"] == 0


def test_status_events_and_metrics_carry_the_workers_steps(daemon, http):
    before = models(daemon)["tiny"]["num_steps"]
    greedy(http, "the capital")
    after = models(daemon)["tiny"]
    assert after["num_steps"] >= before + MAX_TOKENS  # the worker's snapshot, in status
    steps = read_events(http, "step", 5, 5)
    assert steps and all(e["model"] in ("tiny", "tiny2") and e["wall_s"] > 0 for e in steps)
    assert any(e["model"] == "tiny" and e["step_id"] >= after["num_steps"] - 5 for e in steps)
    text = http.get("/metrics").text
    count = next(line for line in text.splitlines()
                 if line.startswith('gpuserv_step_duration_seconds_count{model_name="tiny"}'))
    assert float(count.split()[-1]) >= MAX_TOKENS  # the step hook ran on the worker's records
    assert 'vllm:request_success_total{finished_reason="length",model_name="tiny"}' in text
    assert f'vllm:num_requests_running{{model_name="tiny"}} 0.0' in text


def test_a_killed_worker_fails_only_its_requests_and_the_next_request_starts_a_fresh_one(daemon, http):
    old = models(daemon)["tiny"]["worker_pid"]
    long_body = {"model": "tiny", "prompt": "the capital", "max_tokens": 2000, "ignore_eos": True}
    plain: dict = {}
    streamed: list[str] = []
    streaming = threading.Event()

    def plain_request():
        with daemon.http() as c:
            plain["r"] = c.post(COMP, json=long_body)

    def stream_request():
        with daemon.http() as c, c.stream("POST", COMP, json={**long_body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    streamed.append(line[6:])
                    streaming.set()

    threads = [threading.Thread(target=plain_request), threading.Thread(target=stream_request)]
    for t in threads:
        t.start()
    assert streaming.wait(60)
    wait_until(lambda: models(daemon)["tiny"]["num_running"] == 2, 30, what="both requests running")
    os.kill(old, signal.SIGKILL)
    for t in threads:
        t.join(60)
    r = plain["r"]
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "model_worker_exited"
    assert "model tiny" in err["message"] and "signal 9 (SIGKILL)" in err["message"]
    assert streamed[-1] == "[DONE]"
    assert json.loads(streamed[-2])["error"]["code"] == "model_worker_exited"
    st = models(daemon)["tiny"]
    assert st["state"] == "failed" and "signal 9 (SIGKILL)" in st["error"] and str(old) in st["error"]
    wait_until(lambda: gone(old), 5, what="the dead worker reaped")
    exits = read_events(http, "engine_worker_exit", 1, 1)
    assert exits[0]["model"] == "tiny" and exits[0]["pid"] == old and exits[0]["signal"] == 9
    assert exits[0]["num_failed_requests"] == 2
    # the other model never noticed
    assert greedy(http, "the capital", model="tiny2") == daemon.refs[("the capital", False)]
    # the next request for tiny loads it again, into a fresh worker, with the same tokens
    assert greedy(http, "the capital") == daemon.refs[("the capital", False)]
    st = models(daemon)["tiny"]
    assert st["state"] == "ready" and st["worker_pid"] not in (None, old) and st["error"] is None
    assert "engine_worker_exit" in daemon.log or "exited (killed by signal 9 (SIGKILL))" in daemon.log


def test_unload_and_stop_leave_no_worker_behind(daemon, http):
    """Last in the module: it stops the daemon."""
    ms = models(daemon)
    pids = [ms["tiny"]["worker_pid"], ms["tiny2"]["worker_pid"]]
    assert http.post("/admin/models/tiny2/unload").status_code == 200
    assert gone(pids[1])  # stopped and reaped before the unload answered
    assert not gone(pids[0])
    assert daemon.stop() == 0
    wait_until(lambda: gone(pids[0]), 5, what="the last worker gone with its daemon")
    assert "Traceback" not in daemon.log

"""Nothing a client sends grows the daemon or holds its connections: bogus model names, oversized
bodies, slow senders, TCP bodies without a token; and a double-SIGTERM abort is logged as what it was.
The real daemon over its socket (and TCP)."""

from __future__ import annotations

import json
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon_harness import DaemonProcess, make_home, wait_until, free_port  # noqa: E402

TOKEN = "bounds-token"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("security-bounds")
    home = make_home(tmp, tiny_model_dir)
    (tmp / "token").write_text(TOKEN)
    port = free_port()
    d = DaemonProcess(tmp, home, config={"server": {
        "max_body_bytes": 2 * 1024 * 1024, "header_timeout_s": 1.0, "body_timeout_s": 1.0,
        "tcp": f"127.0.0.1:{port}", "tcp_token_file": str(tmp / "token")}})
    d.port = port
    with d:
        yield d


def _rss(daemon) -> int:
    return psutil.Process(daemon.proc.pid).memory_info().rss


def test_bogus_model_names_do_not_grow_the_daemon(daemon):
    name = "m" * (1024 * 1024)

    def burst(n: int) -> set:
        with daemon.http() as c:
            return {c.post("/v1/completions", json={"model": name, "prompt": "x"}).status_code for _ in range(n)}

    assert burst(20) == {400}  # warm: the allocator's first arenas, the connection
    before = _rss(daemon)
    assert burst(200) == {400}
    grown = _rss(daemon) - before
    assert grown < 5 * 1024 * 1024, f"RSS grew by {grown / 2**20:.1f} MiB over 200 requests with 1 MB names"
    with daemon.http() as c:
        r = c.post("/v1/completions", json={"model": name, "prompt": "x"})
        assert r.json()["error"]["param"] == "model" and len(r.content) < 1000  # the name is not echoed back
        assert "m" * 100 not in daemon.log


def test_a_body_over_the_cap_is_413_read_or_not(daemon):
    big = b'{"model": "tiny", "prompt": "' + b"x" * (3 * 1024 * 1024) + b'"}'
    with daemon.http() as c:
        r = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "server.max_body_bytes" in r.json()["error"]["message"]

        def chunks():  # no Content-Length: counted as it arrives
            for i in range(0, len(big), 65536):
                yield big[i:i + 65536]

        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200


def _closed_by_server(s: socket.socket, within: float = 15.0) -> bool:
    s.settimeout(within)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def test_slow_senders_are_cut_off(daemon):
    heads = []
    for i in range(50):  # the head never ends
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(daemon.socket))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gpuserv\r\nX-Slow: ")
        heads.append(s)
    bodies = []
    for i in range(50):  # the body never ends
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(daemon.socket))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gpuserv\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"model\": ")
        bodies.append(s)
    try:
        assert all(_closed_by_server(s) for s in heads + bodies)
    finally:
        for s in heads + bodies:
            s.close()
    with daemon.http() as c:
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200
    assert "Traceback" not in daemon.log


def test_tcp_without_the_token_is_refused_before_its_body(daemon):
    s = socket.create_connection(("127.0.0.1", daemon.port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gpuserv\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000\r\n\r\n")
        s.settimeout(15)
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 401"), head
        assert _closed_by_server(s)
    finally:
        s.close()


def test_a_second_sigterm_logs_what_it_aborted(tmp_path, tiny_model_dir):
    home = make_home(tmp_path, tiny_model_dir)
    d = DaemonProcess(tmp_path, home, config={"server": {"drain_timeout": 60}})
    try:
        d.wait_ready()
        started = threading.Barrier(4)
        codes = []

        def run():
            with d.http(120) as c, c.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
                started.wait(60)
                for _ in r.iter_lines():
                    pass
                codes.append(r.status_code)

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        started.wait(60)
        d.signal(signal.SIGTERM)
        wait_until(lambda: "draining" in d.log, 10)
        time.sleep(0.2)
        d.signal(signal.SIGTERM)
        d.proc.wait(60)
        for t in threads:
            t.join(30)
    finally:
        d.stop()
    assert "again: aborting 3 requests" in d.log
    assert "drained: 0 finished, 3 aborted" in d.log, d.log[-2000:]


def test_names_that_are_no_model_leave_no_per_name_state(store_home):
    from inprocess_app import run_in_app

    async def check(client, serving):
        for i in range(50):
            r = await client.post("/v1/completions", json={"model": f"ghost-{i}", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 404
        r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200
        models = serving.models
        assert set(models.predictor.rate) == {"tiny"} and set(models.predictor.trans) <= {"tiny"}
        assert not any(n.startswith("ghost") for n in models.slots)

    run_in_app(check, {"engine": {"kv_cache_bytes": "4MiB", "block_size": 4, "num_threads": 1},
                       "cache": {"load_on_demand": True}, "server": {"models": []}}, load=["tiny"])


def _python_level_calls(fn) -> int:
    """How many calls (Python functions and builtins) fn() makes: a count of work that does not depend on
    the machine's speed or load."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_body_of_numbers_is_checked_without_a_step_per_number():
    """The body is parsed and checked on the event loop, which every stream's tokens go through: a 4 MB
    prompt of token ids must not cost a Python step per id (it held every stream for seconds)."""
    from gpuservd.api import json_body

    ids = json.dumps({"model": "tiny", "prompt": [5] * 100_000, "stop_token_ids": [1, 2],
                      "logprobs": 2, "temperature": 0.5}).encode()
    assert json_body.loads(ids)["prompt"] == [5] * 100_000
    assert _python_level_calls(lambda: json_body.loads(ids)) < 1000
    # The same checks still hold inside such lists.
    for raw, message in ((b'{"prompt": [5, 6, NaN]}', "prompt[2] is NaN"),
                         (b'{"prompt": [5, "\\ud800"]}', "prompt[1] holds a lone surrogate"),
                         (b'{"prompt": [5, ' + b"7" * 41 + b"]}", "an integer of 41 digits")):
        with pytest.raises(json_body.BodyError, match=re.escape(message)):
            json_body.loads(raw)

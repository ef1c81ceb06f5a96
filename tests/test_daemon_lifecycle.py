"""The daemon's life under systemd's protocols, with real sockets and signals.

A real datagram NOTIFY_SOCKET receives READY, STATUS, WATCHDOG, RELOADING and
STOPPING; SIGHUP reloads the config while a request streams; SIGTERM drains
(new requests get 503, a short in-flight request finishes, a long one ends
with finish reason "abort") and the daemon exits 0 and removes its socket; a
listening socket handed over through LISTEN_FDS is served as is.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from daemon_harness import PYTHON, ROOT, DaemonProcess, make_home, wait_until


# SIGTERM's drain: the short request must end inside the drain timeout (it needs over SHORT / 6 tokens a
# second) and the long one must not (it would need over LONG / 6), whatever the machine's load; the context
# and the KV cache are sized for the long one.
DRAIN_S = 6.0
SHORT, LONG = 100, 30000
CONFIG = {"server": {"drain_timeout": DRAIN_S}, "engine": {"kv_cache_bytes": "32MiB"}}


@pytest.fixture(scope="module")
def home(tmp_path_factory, tiny_model_dir):
    return make_home(tmp_path_factory.mktemp("lifecycle-home"), tiny_model_dir, context=LONG + 64)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, home):
    tmp = tmp_path_factory.mktemp("lifecycle")
    d = DaemonProcess(tmp, home, config=CONFIG, env={"WATCHDOG_USEC": "300000"})
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop(wait_exit=False)


class Stream:
    """A streaming completion read on a thread; `.finish` is its last finish_reason."""

    def __init__(self, daemon, max_tokens: int):
        self.finish = None
        self.chunks = 0
        self.done_marker = False
        self.started = threading.Event()
        self.error = None
        body = {"model": "tiny", "prompt": "a quick brown fox", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        self.thread = threading.Thread(target=self._run, args=(daemon, body), daemon=True)
        self.thread.start()
        assert self.started.wait(20), self.error

    def _run(self, daemon, body):
        try:
            with daemon.http(timeout=60) as c, c.stream("POST", "/v1/completions", json=body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done_marker = True
                        continue
                    self.chunks += 1
                    self.started.set()
                    reason = json.loads(line[6:])["choices"][0]["finish_reason"]
                    self.finish = reason or self.finish
        except Exception as exc:  # surfaced by the assertions
            self.error = exc
            self.started.set()

    def join(self) -> "Stream":
        self.thread.join(30)
        return self


def test_ready_status_and_watchdog_through_notify_socket(daemon):
    msgs = daemon.notify.wait_for("WATCHDOG=1", 10)
    ready = next(m for m in msgs if "READY=1" in m.splitlines())
    assert f"MAINPID={daemon.proc.pid}" in ready
    assert any(line.startswith("STATUS=serving: tiny ready") for line in ready.splitlines())
    assert any(line.startswith("STATUS=loading tiny") for m in msgs for line in m.splitlines())
    # pings keep coming (every WATCHDOG_USEC / 2) while the engine loop iterates, idle or not
    daemon.notify.wait_for("WATCHDOG=1", 5, n=daemon.notify.count("WATCHDOG=1") + 3)


def test_sighup_reloads_config_without_dropping_a_request(daemon):
    stream = Stream(daemon, 300)
    daemon.write_config({**CONFIG, "server": {**CONFIG["server"], "max_queued_per_model": 3}})
    readies = daemon.notify.count("READY=1")
    daemon.signal(signal.SIGHUP)
    wait_until(lambda: daemon.status()["limits"]["max_queued_per_model"] == 3, 10, what="reload")
    stream.join()
    assert stream.error is None and stream.finish == "length" and stream.chunks >= 1 and stream.done_marker
    daemon.notify.wait_for("RELOADING=1", 5)
    daemon.notify.wait_for("READY=1", 5, n=readies + 1)
    assert "reloaded" in daemon.log and "max_queued_per_model" in daemon.log


def test_a_second_daemon_on_the_same_socket_is_refused(daemon, home):
    env = {**os.environ, "GPUSERV_HOME": str(home)}
    env.pop("NOTIFY_SOCKET", None)
    out = subprocess.run([PYTHON, "-m", "gpuservd.daemon", "--socket", str(daemon.socket), "--model", "tiny"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"a daemon already answers at {daemon.socket}" in out.stderr
    assert daemon.status()["state"] == "serving"


def test_sigterm_drains_then_exits_0(daemon):
    long = Stream(daemon, LONG)  # far past the drain timeout at any speed this engine reaches
    short = Stream(daemon, SHORT)  # well inside it, on a loaded machine too
    assert long.chunks >= 1 and long.finish is None
    daemon.signal(signal.SIGTERM)
    daemon.notify.wait_for("STOPPING=1", 10)
    with daemon.http() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        assert c.get("/ready").status_code == 503
    assert daemon.proc.wait(30) == 0
    short.join()
    long.join()
    assert short.finish == "length" and short.done_marker
    # On failure, say how the long stream ended and what the daemon logged about its drain and shutdown.
    said = [line for line in daemon.log.splitlines() if any(w in line for w in ("drain", "abort", "onnection", "ancel"))]
    why = (f"long: finish={long.finish} [DONE]={long.done_marker} chunks={long.chunks} error={long.error!r} "
           f"still reading={long.thread.is_alive()}; daemon: {said[-12:]}")
    assert long.finish == "abort" and long.done_marker and long.chunks < LONG, why
    assert not daemon.socket.exists()
    assert "drained: 1 finished, 1 aborted" in daemon.log, why


def test_socket_activation_serves_the_handed_over_socket(tmp_path, home):
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    inode = os.stat(path).st_ino
    wrapper = [sys.executable, str(ROOT / "tests" / "listen_fds_wrapper.py"), str(listener.fileno())]
    d = DaemonProcess(tmp_path, home, wrapper=wrapper, pass_fds=(listener.fileno(),), socket_path=path)
    listener.close()  # the daemon holds its own copy, as with systemd
    try:
        d.wait_ready()
        st = d.status()
        assert st["socket"] == str(path) and st["models"][0]["state"] == "ready"
        assert "socket activation: 1 socket(s) from systemd" in d.log
        with d.http() as c:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert os.stat(path).st_ino == inode  # served, not re-created
    finally:
        code = d.stop()
    assert code == 0
    assert path.exists()  # systemd's socket: not ours to remove

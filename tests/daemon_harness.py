"""Start the real daemon as a subprocess on a temporary socket, with a real NOTIFY_SOCKET.

Used by the daemon test modules (one daemon per module where possible). The
tiny test model is imported into a temporary store under the name "tiny".
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# Engine threads, not the default's worker process per CPU model: a worker is a fresh interpreter that
# imports torch (~2 s a load), and these modules test the daemon around its engine, wherever it runs. The
# worker path has its own modules (test_engine_workers.py, test_workers_inprocess.py), auto included.
BASE_CONFIG = {
    "engine": {"kv_cache_bytes": "4MiB", "block_size": 4, "num_threads": 1, "isolation": "thread"},
    "server": {"models": ["tiny"]},
}


def make_home(tmp: Path, model_dir: Path, names=("tiny",), context: int = 2048) -> Path:
    """A GPUSERV_HOME with the tiny model in its store under each name.

    The context is raised (RoPE has no position table, so only config.json changes)
    so that one request can run for a couple of thousand steps: long enough for a
    test to disconnect, cancel or drain while it runs.
    """
    import json
    import shutil

    from gpuservd.store.store import ModelStore

    src = tmp / "model-src"
    shutil.copytree(model_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    (src / "config.json").write_text(json.dumps(cfg))
    home = tmp / "home"
    store = ModelStore(home / "models")
    for name in names:
        store.import_dir(src, name)
    return home


def deep_merge(base: dict, extra: dict) -> dict:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for k, v in (extra or {}).items():
        out[k] = deep_merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


class NotifyListener:
    """A real datagram socket standing in for systemd's NOTIFY_SOCKET."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[str] = []

    def count(self, line: str) -> int:
        return sum(line in m.splitlines() for m in self.messages)

    def wait_for(self, line: str, timeout: float = 60.0, n: int = 1) -> list[str]:
        """Read datagrams until `n` of them hold `line` (e.g. "READY=1"); returns all messages so far."""
        deadline = time.monotonic() + timeout
        while self.count(line) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {line} (x{n}) from the daemon in {timeout} s; got {self.messages}")
            self.sock.settimeout(left)
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                continue
        return self.messages

    def close(self) -> None:
        self.sock.close()


class DaemonProcess:
    """A gpuservd subprocess; its log goes to a file the tests can read."""

    def __init__(self, tmp: Path, home: Path, config: dict | None = None, env: dict | None = None,
                 args: list[str] | None = None, notify: bool = True, wrapper: list[str] | None = None,
                 pass_fds: tuple = (), socket_path: Path | None = None):
        self.tmp = tmp
        self.socket = socket_path or tmp / "gs.sock"
        self.config_path = tmp / "gpuserv.yaml"
        self.write_config(config or {})
        self.log_path = tmp / "daemon.log"
        self.notify = NotifyListener(tmp / "notify.sock") if notify else None
        e = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_", "WATCHDOG_"))}
        e.update({"GPUSERV_HOME": str(home), "PYTHONUNBUFFERED": "1"})
        e.pop("GPUSERV_SOCKET", None)
        if self.notify:
            e["NOTIFY_SOCKET"] = str(self.notify.path)
        e.update(env or {})
        cmd = (wrapper or []) + [PYTHON, "-m", "gpuservd.daemon", "--config", str(self.config_path)]
        if socket_path is not False and not pass_fds:
            cmd += ["--socket", str(self.socket)]
        cmd += args or []
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=self._log,
                                     stderr=subprocess.STDOUT, pass_fds=pass_fds)

    def write_config(self, extra: dict) -> None:
        self.config = deep_merge(BASE_CONFIG, extra)
        self.config_path.write_text(yaml.safe_dump(self.config))

    def _logged_stopped(self) -> bool:
        with open(self.log_path, "rb") as f:
            f.seek(max(0, self.log_path.stat().st_size - 4096))
            return b"INFO gpuservd: stopped" in f.read()

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until READY=1 (through NOTIFY_SOCKET when there is one, else /ready answers 200)."""
        if self.notify:
            try:
                self.notify.wait_for("READY=1", timeout)
            except TimeoutError:
                raise TimeoutError(f"daemon not ready; log:\n{self.log}") from None
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}; log:\n{self.log}")
            try:
                if self.http().get("/ready").status_code == 200:
                    return
            except (httpx.ConnectError, httpx.RemoteProtocolError, FileNotFoundError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"daemon not ready; log:\n{self.log}")

    def http(self, timeout: float = 30.0) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), base_url="http://gpuserv",
                            timeout=timeout)

    def status(self) -> dict:
        with self.http() as c:
            return c.get("/admin/status").json()

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def __enter__(self) -> "DaemonProcess":
        """`with DaemonProcess(...) as d:` waits until it is ready and stops it on the way out, failed or not."""
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop(wait_exit=False)

    def stop(self, timeout: float = 30.0, wait_exit: bool = True) -> int | None:
        """SIGTERM, then wait for the exit (killing it after timeout); its exit code.

        wait_exit=False (a fixture's teardown, where the code is not looked at) waits only until the
        daemon has logged "stopped" (drained, engines stopped, socket removed) and leaves its interpreter's
        own finalization (a second or so of garbage collection over torch's objects) to run beside the
        next test; `reap()` waits for it at the end of the session.
        """
        logs_info = self.config.get("server", {}).get("log_level", "info") in ("info", "debug")
        if not wait_exit and logs_info and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and not self._logged_stopped() and time.monotonic() < deadline:
                time.sleep(0.02)
            _exiting.append(self)
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.notify:
            self.notify.close()
        return self.proc.returncode


_exiting: list[DaemonProcess] = []  # stopped with wait_exit=False; their exits not yet waited for


def reap(timeout: float = 30.0) -> None:
    """Wait for the daemons that were stopped without waiting for their exit (kill any that outlive timeout)."""
    while _exiting:
        _exiting.pop().stop(timeout)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (for a daemon's --tcp)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_completion(daemon, body: dict, out: dict, key, started=None) -> None:
    """Stream one /v1/completions body and put (status, tokens, finish reason, error chunks) in out[key];
    `started` (a threading.Barrier) is waited on once the response has begun, so streams overlap."""
    tokens, errors, finish = 0, [], None
    with daemon.http(120) as c, c.stream("POST", "/v1/completions", json=body) as r:
        if started is not None:
            started.wait(60)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            tokens += len(chunk["choices"][0].get("token_ids") or [])
            finish = chunk["choices"][0].get("finish_reason") or finish
    out[key] = (r.status_code, tokens, finish, errors)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02, what="condition"):
    """what: a description, or a function giving one (called only on timeout, to show the state then)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(interval)

"""A benchmarked server as a subprocess: started with its log in a file, waited for, stopped.

Every HTTP target of `gpuserv bench` (gpuserv's own daemon, llama-server,
vLLM's OpenAI server) runs through this: a new session (so stopping it stops
the whole tree it spawned), stdout and stderr into one log file, readiness by
polling an HTTP path until it answers 200, and SIGTERM then SIGKILL on stop.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerFailed(RuntimeError):
    """The server exited or never became ready; the message ends with its log's tail."""


@dataclass
class ServerSpec:
    """How to start one server and how to tell it is ready."""

    name: str
    cmd: list[str]
    env: dict = field(default_factory=dict)  # added to (and overriding) this process's environment
    ready_path: str = "/health"  # GET until 200
    base_url: str = ""  # http://127.0.0.1:PORT, or any http://NAME with uds
    uds: str | None = None
    ready_timeout_s: float = 600.0
    cwd: str | None = None


def log_tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class ServerProcess:
    """One running server; use as a context manager (ready on entry, stopped on exit)."""

    def __init__(self, spec: ServerSpec, log_path: Path):
        self.spec = spec
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None  # seconds from start to the first 200 on ready_path
        self._old_sigterm = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **{k: str(v) for k, v in self.spec.env.items()}}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.spec.cmd, env=env, cwd=self.spec.cwd, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_ready(self) -> None:
        t0 = time.perf_counter()
        deadline = t0 + self.spec.ready_timeout_s
        transport = httpx.HTTPTransport(uds=self.spec.uds) if self.spec.uds else None
        with httpx.Client(transport=transport, base_url=self.spec.base_url, timeout=10.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise ServerFailed(f"{self.spec.name} exited with code {self.proc.returncode} before it was "
                                       f"ready; log {self.log_path}:\n{log_tail(self.log_path)}")
                try:
                    if http.get(self.spec.ready_path).status_code == 200:
                        self.ready_s = time.perf_counter() - t0
                        return
                except (httpx.HTTPError, OSError):
                    pass
                if time.perf_counter() > deadline:
                    raise ServerFailed(f"{self.spec.name} not ready after {self.spec.ready_timeout_s:.0f} s; "
                                       f"log {self.log_path}:\n{log_tail(self.log_path)}")
                time.sleep(0.5)

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "ServerProcess":
        self._old_sigterm = _raise_on_sigterm()
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._old_sigterm is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)


def _raise_on_sigterm():
    """While a server runs, SIGTERM (a `timeout` around the bench, a CI job's end) raises in the main
    thread so that the `with` block stops the server: Python's default ends the process at once, and
    the server, in a session of its own, would run on as an orphan on the cores the next run measures.
    Returns the handler to restore (None off the main thread, where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, interrupt)

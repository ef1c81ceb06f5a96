"""A spare engine worker process: started ahead, taken by the next load that needs a worker.

A worker is a fresh interpreter (never a fork of the daemon) that imports torch and the engine before it
reads its first message: about 3 s on two cores, which an engine thread does not pay. A load would add
that to its time, and to the first token of a request that waits for an on-demand load. So the daemon
keeps one worker started ahead, blocked on its socket before the WorkerSpec, while a model may go to a
worker without settings of its own (a CPU model under engine.isolation auto or process): one at start-up,
started beside the daemon's own imports, and another whenever a worker's model leaves (unloaded, idle
past keep_alive, or its worker exited), which is when the next load is likely. A load takes it when its
worker would start with the same environment and descriptors (not under MPS, whose settings are fixed
before the process starts); otherwise it starts its own.

It costs an idle interpreter with torch imported (about 250 MB resident) while it waits. It ends when
the daemon says nothing and closes its end (worker/__main__.py returns on EOF before its spec), so it
never outlives the daemon, and `close()` reaps it.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

log = logging.getLogger("gpuservd.worker")


def spawn_worker(env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> tuple[subprocess.Popen, Connection]:
    """`python -m gpuservd.worker FD` with `env` and `pass_fds`, in a session of its own (a terminal's
    Ctrl-C reaches the daemon, which drains, not its workers); returns the process and the daemon's end."""
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "gpuservd.worker", str(theirs.fileno())],
                                pass_fds=(theirs.fileno(), *pass_fds), env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return proc, Connection(ours.detach())


class SpareWorker:
    """At most one worker started ahead with `env` and `pass_fds`; thread-safe."""

    def __init__(self, env: dict[str, str], pass_fds: tuple[int, ...] = ()):
        self.env = env
        self.pass_fds = pass_fds
        self._lock = threading.Lock()
        self._spare: tuple[subprocess.Popen, Connection] | None = None
        self._closed = False

    @property
    def pid(self) -> int | None:
        with self._lock:
            return self._spare[0].pid if self._spare is not None else None

    def ensure(self) -> None:
        """Start a spare unless one waits (or this is closed)."""
        with self._lock:
            if self._closed or (self._spare is not None and self._spare[0].poll() is None):
                return
            old, self._spare = self._spare, None
        if old is not None:
            self._end(old)
        try:
            spare = spawn_worker(self.env, self.pass_fds)
        except OSError as exc:  # loads start their own, as without a spare
            log.warning("no spare engine worker process: %s", exc)
            return
        with self._lock:
            if not self._closed and self._spare is None:
                self._spare, spare = spare, None
        if spare is not None:
            self._end(spare)
        else:
            log.info("spare engine worker process %d started", self.pid)

    def take(self, env: dict[str, str], pass_fds: tuple[int, ...]) -> tuple[subprocess.Popen, Connection] | None:
        """The spare, if it is alive and was started as a worker with this env and these fds would be (a
        descriptor more, the daemon's CPU budget for a worker with a fixed team, is one it never reads)."""
        with self._lock:
            spare = self._spare
            if spare is None or env != self.env or not set(pass_fds) <= set(self.pass_fds):
                if spare is not None:
                    log.info("the spare engine worker process was started otherwise: a worker of its own starts")
                return None
            self._spare = None
        if spare[0].poll() is not None:  # it died waiting (killed by hand): a load starts its own
            self._end(spare)
            return None
        return spare

    def close(self) -> None:
        """End the spare (its socket closes, it returns) and reap it; no spare is started after this."""
        with self._lock:
            self._closed = True
            spare, self._spare = self._spare, None
        if spare is not None:
            self._end(spare)

    @staticmethod
    def _end(spare: tuple[subprocess.Popen, Connection]) -> None:
        """A spare holds nothing yet: SIGTERM (it may still be importing, before it would read the EOF)."""
        proc, conn = spare
        conn.close()
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

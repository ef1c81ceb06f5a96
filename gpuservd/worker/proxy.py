"""The daemon's side of an engine worker process: `WorkerLoop`, with EngineLoop's surface.

serving/models.py holds a WorkerLoop where it would hold an EngineLoop (`slot.loop`):
submit, abort, call, set_arbiter, stop, alive, snapshot (its heartbeat), ready,
facts(), recent_steps(). The engine runs in a child process started with
subprocess (a fresh interpreter: no fork of a process with threads and torch),
`python -m gpuservd.worker FD`, with the environment the daemon chose for it
(MPS variables under the mps backend) fixed before the process starts. One
socketpair carries pickled messages both ways (the protocol is in
worker/__main__.py); a reader thread here turns the worker's messages into the
same `on_post(deliveries, events)` calls on the event loop an engine thread
makes, and calls the metrics hooks with the worker's step records.

What cannot cross the boundary is refused, never approximated: `call(fn)`
needs a picklable fn (gpuservd.engine.calls), `set_arbiter` accepts only None
(the arbiter paces engine threads of this process).

A worker that exits unasked (killed, crashed) fails its in-flight requests
with `EngineGone` (HTTP 503 naming the model), fails pending calls, is reaped
at once (no zombie), and `on_death(exit_info)` runs on the event loop. `stop()`
asks the worker to abort what is left and exit, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import pickle
import signal
import subprocess
import threading
from collections import deque
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from gpuservd.engine.loop import EngineGone, Failed, LoopSnapshot, Submission
from gpuservd.errors import UserError
from gpuservd.events.types import StepRecord
from gpuservd.worker.spare import SpareWorker, spawn_worker

log = logging.getLogger("gpuservd.worker")
TERM_AFTER_S = 10.0  # a worker asked to stop gets this long before SIGTERM (stop()'s default timeout)
KILL_AFTER_S = 5.0  # and this long after SIGTERM before SIGKILL
# the daemon's own systemd and socket-activation variables stay with the daemon
PRIVATE_ENV = ("NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID")


def describe_exit(code: int | None) -> str:
    """A worker's exit status for a person: 'exit code 1' or 'killed by signal 9 (SIGKILL)'."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-code} ({name})"
    return f"exit code {code}"


def worker_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without its systemd variables, plus `extra` (MPS settings), and the
    directory gpuservd is imported from on PYTHONPATH (a source checkout works as an installed one)."""
    env = {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}
    root = str(Path(__file__).resolve().parent.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(extra or {})
    return env


def _ends(item) -> bool:
    """Is this the last thing a request's sink receives?"""
    return isinstance(item, Failed) or bool(getattr(item, "finished", False))


class WorkerLoop:
    """One model's engine in a worker process (an engine.loop.AnyEngineLoop)."""

    isolation = "process"
    engine = None  # the engine lives in the worker; ask it through call()
    arbiter = None  # time slices pace engine threads of the daemon only

    def __init__(self, model: str, spec, loop: asyncio.AbstractEventLoop, on_post: Callable[[list, list], None],
                 hooks=None, env: dict[str, str] | None = None, on_layer: Callable[[int, float], None] | None = None,
                 on_death: Callable[["WorkerLoop", dict], None] | None = None, spare: SpareWorker | None = None):
        self.model = model
        self.spare = spare  # a worker started ahead, taken by start() when it was started as this one would be
        self.spec = spec  # worker.build.WorkerSpec
        self.env = dict(env or {})  # what this worker's environment adds (MPS variables)
        self.ready: concurrent.futures.Future = concurrent.futures.Future()  # EngineFacts, once built
        self.snapshot = LoopSnapshot(model)  # the worker's, replaced by each message that carries one
        self.exit: dict | None = None  # pid, exit_code, signal, reason once the process has ended
        self.proc: subprocess.Popen | None = None
        self._loop = loop
        self._on_post = on_post
        self._hooks = hooks
        self._on_layer = on_layer
        self._on_death = on_death
        self._admission_window_s = spec.admission_window_s
        self._steps: deque[StepRecord] = deque(maxlen=spec.engine.telemetry_ring_size)  # step events, for replays
        self._facts = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._sinks: dict[str, Any] = {}  # request_id -> sink
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._next_call = 0
        self._stopping = False
        self._gone = False  # the process has exited and been reaped
        self._conn: Connection | None = None
        self._reader = threading.Thread(target=self._read, name=f"worker-{model}", daemon=True)

    # ---- any thread -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker, or take the spare when it was started as this one would be."""
        budget_fd = (self.spec.cpu_budget[0],) if self.spec.cpu_budget is not None else ()  # the same number there
        env = worker_environment(self.env)
        taken = self.spare.take(env, budget_fd) if self.spare is not None else None
        self.proc, self._conn = taken or spawn_worker(env, budget_fd)
        log.info("model %s: engine worker process %d %s%s", self.model, self.proc.pid,
                 "taken (the spare started ahead)" if taken else "started",
                 f" with {' '.join(f'{k}={v}' for k, v in sorted(self.env.items()))}" if self.env else "")
        self._send(("spec", self.spec))
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self._gone and self.proc.poll() is None

    @property
    def admission_window_s(self) -> float:
        return self._admission_window_s

    @admission_window_s.setter
    def admission_window_s(self, seconds: float) -> None:
        self._admission_window_s = seconds
        self._send(("window", seconds))

    def facts(self):
        """The worker's EngineFacts (after `ready`)."""
        return self._facts

    def recent_steps(self, n: int) -> list[StepRecord]:
        """The last n step records the worker sent (a replay for /admin/events?recent=n)."""
        steps = list(self._steps)
        return steps[-n:] if n > 0 else []

    def submit(self, sub: Submission) -> None:
        with self._lock:
            gone = self._gone
            if not gone:
                self._sinks[sub.request_id] = sub.sink
        if gone:
            self._post([(sub.sink, EngineGone(sub.request_id, self.model, self.exit["reason"]))], [])
            return
        self._send(("submit", sub.request_id, sub.prompt_token_ids, sub.params, sub.priority, sub.tenant,
                    sub.arrival_time))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) in the worker between steps; fn must pickle (a module-level function, or a
        functools.partial of one: see gpuservd.engine.calls)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            pickle.dumps(fn)
        except Exception as exc:
            fut.set_exception(TypeError(
                f"model {self.model} runs in an engine worker process (engine.isolation: process) and {fn!r} "
                f"cannot be sent to it ({exc}); use a module-level function (gpuservd/engine/calls.py)"))
            return fut
        with self._lock:
            if self._gone:
                fut.set_exception(RuntimeError(f"model {self.model}: its engine worker exited ({self.exit['reason']})"))
                return fut
            call_id = self._next_call = self._next_call + 1
            self._calls[call_id] = fut
        self._send(("call", call_id, fn))
        return fut

    def set_arbiter(self, handle) -> concurrent.futures.Future:
        if handle is not None:
            raise UserError(f"model {self.model} runs in an engine worker process: the arbiter's time slices pace "
                            "engine threads of the daemon only (engine.isolation: thread)")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(None)
        return fut

    def stop(self, timeout: float | None = TERM_AFTER_S) -> None:
        """Ask the worker to abort what is left and exit; SIGTERM after `timeout`, SIGKILL KILL_AFTER_S later.
        Returns once the process is reaped."""
        with self._lock:
            self._stopping = True
        if self.proc is None:
            return
        timeout = TERM_AFTER_S if timeout is None else timeout
        if self.proc.poll() is None:
            self._send(("stop", max(0.1, timeout - 1.0)))
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("model %s: engine worker %d did not stop in %.0f s; SIGTERM", self.model, self.proc.pid,
                        timeout)
            self.proc.terminate()
            try:
                self.proc.wait(KILL_AFTER_S)
            except subprocess.TimeoutExpired:
                log.warning("model %s: engine worker %d ignored SIGTERM; SIGKILL", self.model, self.proc.pid)
                self.proc.kill()
                self.proc.wait()
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(KILL_AFTER_S)

    def _send(self, msg: tuple) -> None:
        if self._conn is None:
            return
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, EOFError, ValueError):  # the worker is gone: the reader fails what it held
            pass

    def _post(self, deliveries: list, events: list) -> None:
        try:
            self._loop.call_soon_threadsafe(self._on_post, deliveries, events)
        except RuntimeError:  # the event loop is closed: the daemon is exiting
            pass

    # ---- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                try:
                    msg = self._conn.recv()
                except (EOFError, OSError):
                    return
                try:
                    self._handle(msg)
                except Exception:
                    log.exception("model %s: a message from its engine worker could not be handled", self.model)
        finally:
            self._ended()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "post":
            _, deliveries, events, hooks, snapshot = msg
            self.snapshot = snapshot
            out = []
            with self._lock:
                for rid, item in deliveries:
                    sink = self._sinks.pop(rid, None) if _ends(item) else self._sinks.get(rid)
                    if sink is not None:
                        out.append((sink, item))
            self._run_hooks(hooks)
            self._steps.extend(e for e in events if isinstance(e, StepRecord))
            if out or events:
                self._post(out, events)
        elif kind == "beat":
            self.snapshot = msg[1]
            self._run_hooks(msg[2])
        elif kind == "result":
            _, call_id, ok, value = msg
            with self._lock:
                fut = self._calls.pop(call_id, None)
            if fut is not None:
                fut.set_result(value) if ok else fut.set_exception(value)
        elif kind == "layer":
            if self._on_layer is not None:
                self._on_layer(msg[1], msg[2])
        elif kind == "ready":
            self._facts = msg[1]
            self.ready.set_result(msg[1])
        elif kind == "build_failed":
            self.ready.set_exception(msg[1])

    def _run_hooks(self, hooks: list[tuple]) -> None:
        if self._hooks is None:
            return
        for hook in hooks:
            if hook[0] == "step":
                self._hooks.on_step(self.model, hook[1], hook[2])
            else:
                self._hooks.on_abort(self.model, hook[1])

    def _ended(self) -> None:
        """The socket closed: reap the process, fail what it held, report an exit nobody asked for."""
        code = self.proc.wait()  # reaped here: no zombie
        reason = describe_exit(code)
        self.exit = {"pid": self.proc.pid, "exit_code": code if code >= 0 else None,
                     "signal": -code if code < 0 else None, "reason": reason}
        with self._lock:
            self._gone = True
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
            stopping = self._stopping
        self._conn.close()
        for fut in calls.values():
            if not fut.done():
                fut.set_exception(RuntimeError(f"model {self.model}: its engine worker exited ({reason})"))
        if not self.ready.done():
            self.ready.set_exception(RuntimeError(
                f"the engine worker of model {self.model} (pid {self.proc.pid}) exited ({reason}) before its "
                "engine was built; its log lines above say why"))
        if sinks:
            self._post([(sink, EngineGone(rid, self.model, reason)) for rid, sink in sinks.items()], [])
        if stopping:
            log.info("model %s: engine worker %d stopped (%s)", self.model, self.proc.pid, reason)
            return
        log.error("model %s: engine worker %d exited (%s); %d requests failed", self.model, self.proc.pid, reason,
                  len(sinks))
        if self._on_death is not None:
            try:
                self._loop.call_soon_threadsafe(self._on_death, self, {**self.exit,
                                                                       "num_failed_requests": len(sinks)})
            except RuntimeError:
                pass

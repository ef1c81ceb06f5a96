"""The engine thread: the only thread that touches an LLMEngine.

The asyncio side talks to it through a thread-safe inbox (submit, abort, call).
The thread applies the inbox, runs one `step()` while work exists and sleeps
on a condition when idle. Everything it produces in one iteration (request
outputs, acknowledgements, per-step records, events) goes back to the event
loop in ONE wake-up (engine/wakeup.py), so 200 streams cost one wake-up per step,
not 200. An abort is applied at the top of the next iteration: a cancelled
request's KV blocks are free within one engine step.

`heartbeat` advances on every iteration, busy or idle (the idle wait has a
timeout), so the watchdog can tell a stuck engine from a quiet one.

The engine is also *built* on this thread (`ready` resolves when it is): with
torch's OpenMP pool, an engine built on one thread and stepped on another ran
30-40% slower on a 2-core CPU (measured on SmolLM2); built and stepped on the
same thread it runs as fast as in-process.

The same loop runs inside an engine worker process (`engine.isolation:
process`, gpuservd/worker/): there `loop` is the worker's Poster, which sends
each iteration's deliveries, events, hook calls and snapshot to the daemon,
where worker/proxy.py's WorkerLoop stands in for this class.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

from gpuservd.engine.calls import EngineFacts
from gpuservd.engine.step_events import detail_events
from gpuservd.engine.wakeup import Wakeup
from gpuservd.errors import UserError
from gpuservd.events.types import EngineError, Event, StepRecord
from gpuservd.kv_cache.prefault import PoolCommitter
from gpuservd.runner.omp import PoolPriority

log = logging.getLogger("gpuservd.engine.loop")

IDLE_TICK_S = 0.5  # an idle loop still wakes this often, for the heartbeat
GATHER_GAP_S = 0.0025  # an admission window closes early after this long without a new arrival...
BURST_GAP_S = 0.010  # ...or this long, once a second arrival has shown a burst (see _gather)
DETAIL_EVERY_S = 0.25  # a busy engine's snapshot renews its status dicts this often (see _beat)


@dataclass
class Submission:
    """A request for the engine thread to queue."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any  # engine.request.SamplingParams
    sink: Any  # has .put(item), called on the event loop thread
    priority: int = 0
    tenant: str = "default"
    arrival_time: float | None = None  # monotonic; when the HTTP request arrived


@dataclass
class Accepted:
    """The engine queued the request (sent before any output)."""

    request_id: str


@dataclass
class Failed:
    """The request could not be queued (UserError) or the engine failed while running it."""

    request_id: str
    error: BaseException
    internal: bool  # True: our bug or a device fault (HTTP 500), False: the request is bad (400)
    error_id: str = ""  # the id the traceback is logged under (internal errors)


@dataclass
class EngineGone:
    """The engine's worker process exited under the request (engine.isolation: process); HTTP 503."""

    request_id: str
    model: str
    reason: str  # e.g. "killed by signal 9 (SIGKILL)", "exit code 1"

    @property
    def message(self) -> str:
        return (f"model {self.model}: its engine worker process exited ({self.reason}) and the request was "
                "lost; retry it (the next request starts a fresh worker)")


@dataclass
class LoopSnapshot:
    """What the engine thread last saw; replaced whole after every iteration, read from any thread."""

    model: str
    num_running: int = 0  # sequences in the batch
    num_waiting: int = 0  # queued in the scheduler
    num_requests: int = 0  # unfinished requests the engine holds
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_steps: int = 0  # engine steps so far
    heartbeat: float = field(default_factory=time.monotonic)  # monotonic time of the last iteration
    num_engine_errors: int = 0  # steps that raised
    preemption: dict | None = None  # the scheduler's preemption state (engine.preemption_status())
    decode: dict | None = None  # how decode steps run: CUDA graphs or eager, and why (engine.decode_status())
    prefix_cache: dict | None = None  # on/off, query and hit tokens, cached blocks (engine.prefix_cache_status())


class EngineHooks(Protocol):
    """Called on the engine thread (cheap and thread-safe: metrics)."""

    def on_step(self, model: str, record: Any, outputs: list) -> None: ...

    def on_abort(self, model: str, output: Any) -> None: ...


@runtime_checkable
class AnyEngineLoop(Protocol):
    """What the daemon (a model's slot, the admin routes, metrics) and the benchmarks ask of one model's
    running engine, wherever it runs: `EngineLoop` below (a thread of this process; the isolation bench
    drives these directly) or `worker.proxy.WorkerLoop` (an engine worker process, engine.isolation:
    process). Everything crosses as data: submissions and aborts in, deliveries and events out through
    `on_post` on the event loop, `call(fn)` for anything else (fn must pickle: engine/calls.py)."""

    model: str  # the model it runs
    isolation: str  # thread | process
    snapshot: LoopSnapshot  # what the engine last reported; replaced whole, read from any thread
    ready: concurrent.futures.Future  # resolves once the engine is built (raises if the build failed)
    admission_window_s: float  # how long an idle engine waits to batch a burst (a reload changes it)
    engine: Any  # the engine object when it lives in this process; None in a worker process

    @property
    def pid(self) -> int | None:
        """The worker process's pid; None when the engine runs in this process."""

    @property
    def alive(self) -> bool:
        """The loop (thread or process) is running."""

    def start(self) -> None:
        """Build the engine (on its thread or in its process) and start stepping."""

    def submit(self, sub: Submission) -> None:
        """Queue a request; its outputs go to `sub.sink` (Accepted first, or Failed / EngineGone)."""

    def abort(self, request_id: str) -> None:
        """Abort a request at the next iteration (its KV blocks are free within one step)."""

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) between steps; the future holds its result."""

    def set_arbiter(self, handle) -> concurrent.futures.Future:
        """Share the device through an arbiter handle from the next step on (None: step freely)."""

    def stop(self, timeout: float | None = ...) -> None:
        """Abort what is left, end the loop and wait for it."""

    def facts(self) -> Any:
        """The built engine's engine.calls.EngineFacts (after `ready`)."""

    def recent_steps(self, n: int) -> list[StepRecord]:
        """The last n step records (a replay for /admin/events?recent=n)."""


class EngineLoop:
    """One model's engine on its own thread (an AnyEngineLoop)."""

    isolation = "thread"
    pid = None  # a worker process's pid (worker/proxy.py); None: this process

    def __init__(self, model: str, build: Callable[[], Any], loop: asyncio.AbstractEventLoop,
                 on_post: Callable[[list, list], None], hooks: EngineHooks | None = None,
                 admission_window_s: float = 0.0, arbiter=None, on_exit: Callable[[], None] | None = None,
                 seat=None):
        self.model = model
        self._on_exit = on_exit  # called on the engine thread as it ends (a partition's unbind)
        # sharing.arbiter.ArbiterHandle when the device is shared (time slices, bandwidth priority): asked before each step and
        # between layers, told when the loop goes idle; None = this engine steps whenever it has work.
        self.arbiter = arbiter
        # runner.cpu_budget.BudgetSeat: the engines stepping at once split the cores, each step takes its
        # share as its OpenMP team; None = the engine's own fixed count. Unused under the arbiter, whose
        # time slices already keep one engine of a device stepping at a time.
        self.seat = seat
        # When a request wakes an idle engine, wait up to this long for more arrivals (ending early
        # after GATHER_GAP_S without one), so that a burst is prefilled in one step instead of
        # the first request alone and the rest a step later.
        self.admission_window_s = admission_window_s
        self.engine = None  # set on the engine thread by build()
        self.ready: concurrent.futures.Future = concurrent.futures.Future()  # the engine, once built
        self._build = build
        self._loop = loop
        self._wakeup = Wakeup(loop)  # how _publish wakes the event loop (wakeup.py says why not call_soon_threadsafe)
        self._on_post = on_post  # (deliveries [(sink, item)], events [dict]) on the event loop
        self._hooks = hooks
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._stopping = False
        self._sinks: dict[str, Any] = {}  # request_id -> sink, engine thread only
        self._row_failed: dict[str, Exception] = {}  # request_id -> why its own sampling raised (engine thread)
        self._records: list = []  # StepRecords produced during this iteration
        self.snapshot = LoopSnapshot(self.model)
        self._detail_at = float("-inf")  # monotonic time the snapshot's status dicts were last made
        self._thread = threading.Thread(target=self._run, name=f"engine-{self.model}", daemon=True)

    # ---- any thread -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, sub: Submission) -> None:
        self._put(("submit", sub))

    def abort(self, request_id: str) -> None:
        self._put(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, fut))
        return fut

    def set_arbiter(self, handle) -> concurrent.futures.Future:
        """Share the device through `handle` from the next step on (None: step freely again)."""
        def apply(engine):
            if self.arbiter is not None and self.arbiter is not handle:
                self.arbiter.close()
            self.arbiter = handle
            engine.yield_point = handle.between_layers if handle is not None else None
            engine.device_alone = handle.alone if handle is not None else None

        return self.call(apply)

    def stop(self, timeout: float | None = 10.0) -> None:
        """Abort whatever is left (finish reason abort), end the thread and wait for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self.arbiter is not None:
            self.arbiter.close()  # wakes the thread if it waits for its turn
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._wakeup.close()  # after the thread's last post, which still runs on the loop
        if self.engine is not None:
            self.engine.telemetry.unsubscribe(self._records.append)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def facts(self):
        """The built engine's EngineFacts (after `ready`)."""
        return EngineFacts.of(self.engine)

    def recent_steps(self, n: int) -> list[StepRecord]:
        """The last n step records (a replay for /admin/events?recent=n)."""
        if self.engine is None:
            return []
        return self.engine.telemetry.recent(n)

    def _put(self, cmd: tuple) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._cond.notify()

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop_body()
        finally:
            if self._on_exit is not None:
                try:
                    self._on_exit()
                except Exception:
                    log.exception("engine thread %s: exit hook failed", self.model)

    def _loop_body(self) -> None:
        try:
            engine = self.engine = self._build()
        except BaseException as exc:
            self.ready.set_exception(exc)
            return
        engine.telemetry.subscribe(self._records.append)
        engine.interrupt = self._urgent_waiting
        # A CPU engine's OpenMP workers yield to the event loop where GPUSERV_OMP_WORKER_PRIORITY asks
        # (runner/omp.py); a GPU process's native threads are the driver's, left as they are.
        device = getattr(getattr(engine, "runner", None), "device", None)
        pool = PoolPriority() if getattr(device, "type", None) == "cpu" else None
        if self.arbiter is not None:
            engine.yield_point = self.arbiter.between_layers
            engine.device_alone = self.arbiter.alone
        # An idle CPU engine commits its KV pool's pages ahead of their first write (kv_cache/prefault.py).
        committer = PoolCommitter.for_cache(getattr(getattr(engine, "runner", None), "cache", None))
        self._beat()
        self.ready.set_result(engine)
        while True:
            arbiter = self.arbiter  # set_arbiter() may change it between iterations
            if arbiter is not None and not engine.has_unfinished():
                arbiter.idle()  # nothing to run: the device goes to the others now, not after a quantum
            with self._cond:
                self._wait_for_work(engine, committer)
                if self.admission_window_s and not engine.has_unfinished() and not self._stopping:
                    self._gather()
                cmds, self._inbox = self._inbox, []
                stopping = self._stopping
            deliveries: list[tuple] = []
            events: list[Event] = []
            for cmd in cmds:
                self._apply(cmd, deliveries)
            if stopping:
                for rid in list(self._sinks):
                    self._abort(rid, deliveries)
                self._publish(deliveries, events)
                return
            for rid, why in engine.unservable():  # a memory quota lowered under what they need
                self._fail_unservable(rid, why, deliveries)
            outputs = []
            if engine.has_unfinished():
                if arbiter is not None:
                    arbiter.begin_step()  # may wait for this model's turn
                seat = self.seat if arbiter is None else None
                if seat is not None:
                    engine.num_threads = seat.enter()  # the step re-asserts its team size (runner/omp.py)
                try:
                    outputs = engine.step()
                except Exception as exc:  # a bug or a device fault: fail the requests, keep the thread
                    self._engine_failed(exc, deliveries, events)
                finally:
                    if seat is not None:
                        seat.leave()
                    if pool is not None:
                        pool.after_step()
                    if arbiter is not None:
                        arbiter.end_step(decode_only=all(not r.num_prefill_tokens for r in self._records))
                self._row_failed.update(engine.rows.take())  # their abort outputs may come a step later
                for out in outputs:
                    if out.request_id in self._row_failed:  # its own row raised: it alone ends, as a 500
                        self._request_failed(out.request_id, self._row_failed.pop(out.request_id), deliveries, events)
                        continue
                    sink = self._sinks.get(out.request_id)
                    if out.finished:
                        self._sinks.pop(out.request_id, None)
                    if sink is not None:
                        deliveries.append((sink, out))
            records = self._records[:]
            self._records.clear()
            for rec in records:
                events.append(rec)
                events.extend(detail_events(rec))
                if self._hooks is not None:
                    self._hooks.on_step(self.model, rec, outputs)
            if arbiter is not None:
                events.extend(arbiter.take_events())  # time slices and throttling, of every model
            self._beat()
            if deliveries or events:
                self._publish(deliveries, events)

    def _wait_for_work(self, engine, committer: PoolCommitter | None) -> None:
        """With the condition held, until there is something to do: commit the KV pool a page at a time
        (the lock released for each, so submit() can post meanwhile), else sleep; beat every IDLE_TICK_S."""
        beat_at = time.monotonic() + IDLE_TICK_S
        while not self._inbox and not self._stopping and not engine.has_unfinished():
            if committer is None or committer.done:
                self._cond.wait(IDLE_TICK_S)
            else:
                self._cond.release()
                try:
                    committer.commit_next()
                finally:
                    self._cond.acquire()
                if time.monotonic() < beat_at:
                    continue
            self._beat()
            beat_at = time.monotonic() + IDLE_TICK_S

    def _gather(self) -> None:
        """With the condition held, the engine idle and the inbox non-empty: wait for the rest of a burst,
        until admission_window_s has passed or no request came for a gap.
        A lone request waits GATHER_GAP_S; once a second one comes, BURST_GAP_S between arrivals (64
        streams of one client reached the daemon over ~46 ms, in runs 4.5 ms apart). The step it opens
        decides who holds the batch: chosen from 10 of 64 it once admitted a long request that held a
        slot through the whole short phase (README: "A burst reaches the engine")."""
        deadline = time.monotonic() + self.admission_window_s
        gap = GATHER_GAP_S
        while not self._stopping:
            seen = len(self._inbox)
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(min(gap, left))
            if len(self._inbox) == seen:
                return
            gap = BURST_GAP_S

    def _beat(self) -> None:
        e = self.engine
        s = self.snapshot
        now = time.monotonic()
        # The three status dicts cost ~0.2 ms of the engine thread at 48 running (preemption's sums over the
        # queues): between two steps of a busy engine, which in-process runs never pay. Their readers
        # (/admin/status, the gauges, the hints) take them a fraction of a second old; an idle engine's are fresh.
        if now - self._detail_at >= DETAIL_EVERY_S or not e.has_unfinished():
            self._detail_at = now
            detail = e.preemption_status(), e.decode_status(), e.prefix_cache_status()
        else:
            detail = s.preemption, s.decode, s.prefix_cache
        self.snapshot = LoopSnapshot(
            self.model, len(e.scheduler.running), len(e.scheduler.waiting), len(e.requests), e.pool.num_used,
            e.pool.num_blocks, e.telemetry.num_steps, now, s.num_engine_errors, *detail)

    def _apply(self, cmd: tuple, deliveries: list) -> None:
        kind = cmd[0]
        if kind == "submit":
            sub: Submission = cmd[1]
            try:
                self.engine.add_request(sub.request_id, sub.prompt_token_ids, sub.params, priority=sub.priority,
                                        tenant=sub.tenant, arrival_time=sub.arrival_time)
            except Exception as exc:  # UserError: a bad request; anything else is ours
                internal = not isinstance(exc, UserError)
                error_id = self._log_internal(exc, sub.request_id) if internal else ""
                deliveries.append((sub.sink, Failed(sub.request_id, exc, internal, error_id)))
                return
            self._sinks[sub.request_id] = sub.sink
            deliveries.append((sub.sink, Accepted(sub.request_id)))
        elif kind == "abort":
            self._abort(cmd[1], deliveries)
        elif kind == "call":
            fn, fut = cmd[1], cmd[2]
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:
                    fut.set_exception(exc)

    def _abort(self, request_id: str, deliveries: list) -> None:
        """Abort in the engine (frees its KV blocks now) and hand the sink the final `abort` output."""
        sink = self._sinks.pop(request_id, None)
        try:
            out = self.engine.abort(request_id)
        except Exception as exc:
            self._log_internal(exc, request_id)
            out = None
        if out is not None:
            if sink is not None:
                deliveries.append((sink, out))
            if self._hooks is not None:
                self._hooks.on_abort(self.model, out)

    def _fail_unservable(self, request_id: str, why: str, deliveries: list) -> None:
        sink = self._sinks.pop(request_id, None)
        try:
            self.engine.abort(request_id)  # its KV blocks are free now
        except Exception as exc:
            self._log_internal(exc, request_id)
        log.warning("request %s (model %s) failed: %s", request_id, self.model, why)
        if sink is not None:
            deliveries.append((sink, Failed(request_id, UserError(why), False)))

    def _engine_failed(self, exc: Exception, deliveries: list, events: list) -> None:
        error_id = self._log_internal(exc, "step")
        self.snapshot.num_engine_errors += 1
        events.append(EngineError(model=self.model, error_id=error_id, error=f"{type(exc).__name__}: {exc}",
                                  num_failed_requests=len(self._sinks)))
        for rid, sink in list(self._sinks.items()):
            deliveries.append((sink, Failed(rid, exc, True, error_id)))
            try:
                self.engine.abort(rid)
            except Exception:  # the engine may be wedged; the requests are failed either way
                pass
        self._sinks.clear()

    def _request_failed(self, request_id: str, exc: Exception, deliveries: list, events: list) -> None:
        """One request's own row raised in a step: it alone fails (HTTP 500 naming it); the batch goes on."""
        error_id = self._log_internal(exc, request_id)
        self.snapshot.num_engine_errors += 1
        events.append(EngineError(model=self.model, error_id=error_id, num_failed_requests=1,
                                  error=f"request {request_id}: {type(exc).__name__}: {exc}"))
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            deliveries.append((sink, Failed(request_id, exc, True, error_id)))

    def _urgent_waiting(self, priority: int) -> bool:
        """Engine thread, mid-forward (layer granularity): is a request above `priority` in the inbox?
        Reads the list without the lock: it is only ever replaced whole or appended to."""
        return any(cmd[0] == "submit" and cmd[1].priority > priority for cmd in list(self._inbox))

    def _log_internal(self, exc: BaseException, request_id: str) -> str:
        error_id = f"err-{uuid.uuid4().hex[:12]}"
        log.error("internal error %s (model %s, request %s): %s\n%s", error_id, self.model, request_id, exc,
                  "".join(traceback.format_exception(exc)).rstrip())
        return error_id

    def _publish(self, deliveries: list, events: list[Event]) -> None:
        self._wakeup.post(self._on_post, deliveries, events)


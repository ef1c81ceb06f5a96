"""An engine worker process: `python -m gpuservd.worker FD` (started by worker/proxy.py, never by hand).

FD is this end of a socketpair with the daemon. The first message is the
WorkerSpec; the worker builds the engine from the store and runs the very same
step loop as an engine thread (engine.loop.EngineLoop), whose event loop is
replaced by a `Poster` that pickles each iteration's deliveries, events, hook
calls and snapshot back to the daemon in one message.

Its environment is set by the daemon before the process starts (under MPS:
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, before any
CUDA context exists). The process ends when the daemon says stop, or when the
socket closes (the daemon is gone): it never outlives its daemon.

Daemon -> worker: ("spec", WorkerSpec), ("submit", request_id, prompt_ids,
params, priority, tenant, arrival_time), ("abort", request_id), ("call", id,
fn), ("window", seconds), ("stop", timeout_s).
Worker -> daemon: ("layer", i, seconds), ("ready", EngineFacts),
("build_failed", exc), ("post", [(request_id, item)], [event], [hook call],
LoopSnapshot), ("beat", LoopSnapshot, [hook call]), ("result", id, ok, value),
("stopped",).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from multiprocessing.connection import Connection

from gpuservd.engine.calls import EngineFacts
from gpuservd.engine.loop import IDLE_TICK_S, EngineLoop, Failed, Submission
from gpuservd.runner.cpu_budget import BudgetSeat, CpuBudget
from gpuservd.runner.omp import use_threads
from gpuservd.weights.sources import store_source
from gpuservd.worker.build import make_engine

log = logging.getLogger("gpuservd.worker")


def picklable_error(exc: BaseException) -> BaseException:
    """exc itself when it pickles, else a RuntimeError carrying its type and message."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class RemoteSink:
    """Stands in for a request's sink on the daemon side: only its request id travels."""

    def __init__(self, request_id: str):
        self.request_id = request_id


class Channel:
    """The socket to the daemon; sends come from the engine thread, the main thread and the beat thread."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: tuple) -> None:
        try:
            with self._lock:
                self.conn.send(msg)
        except (OSError, EOFError):  # the daemon is gone; the main thread sees EOF and ends the process
            pass


class Poster:
    """Replaces the asyncio loop EngineLoop posts to: `call_soon_threadsafe(on_post, deliveries, events)`
    sends them at once, with the hook calls made since and the loop's snapshot."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.loop: EngineLoop | None = None
        self._hooks: list[tuple] = []
        self._lock = threading.Lock()

    # EngineHooks, called on the engine thread: forwarded to the daemon's metrics
    def on_step(self, model: str, record, outputs: list) -> None:
        with self._lock:
            self._hooks.append(("step", record, list(outputs)))

    def on_abort(self, model: str, output) -> None:
        with self._lock:
            self._hooks.append(("abort", output))

    def take_hooks(self) -> list[tuple]:
        with self._lock:
            hooks, self._hooks = self._hooks, []
        return hooks

    def call_soon_threadsafe(self, fn, *args) -> None:
        fn(*args)

    def post(self, deliveries: list, events: list) -> None:
        out = []
        for sink, item in deliveries:
            if isinstance(item, Failed):
                item = Failed(item.request_id, picklable_error(item.error), item.internal, item.error_id)
            out.append((sink.request_id, item))
        self.channel.send(("post", out, events, self.take_hooks(), self.loop.snapshot))

    def beat(self) -> None:
        self.channel.send(("beat", self.loop.snapshot, self.take_hooks()))


def build(spec, channel: Channel, facts: list):
    """The engine, from the store (the same construction as an engine thread's); its EngineFacts go
    into `facts`."""
    source, tier, nbytes = store_source(spec.model_dir, spec.compression)

    def on_layer(i: int, seconds: float) -> None:
        channel.send(("layer", i, seconds))

    engine = make_engine(spec.model, spec.config_dir, spec.engine, source, spec.initial_layers, on_layer,
                         spec.tenant_quotas)
    facts.append(EngineFacts.of(engine, tier, nbytes))
    return engine


def serve(conn: Connection) -> int:
    channel = Channel(conn)
    try:
        kind, spec = conn.recv()
    except (EOFError, OSError):  # a spare (worker/spare.py) the daemon closed, or a daemon gone before the spec
        return 0
    assert kind == "spec", kind
    logging.basicConfig(level=spec.log_level.upper(), stream=sys.stderr,
                        format=f"%(levelname)s gpuservd.worker[{spec.model} pid {os.getpid()}] %(name)s: %(message)s")
    use_threads(1)  # this thread only relays messages; the engine thread owns the OpenMP team (runner/omp.py)
    poster = Poster(channel)
    facts: list = []
    seat = None
    if spec.cpu_budget is not None:
        fd, slot, cores = spec.cpu_budget
        seat = BudgetSeat(CpuBudget(cores, fd), slot)
    loop = EngineLoop(spec.model, lambda: build(spec, channel, facts), poster, poster.post, hooks=poster,
                      admission_window_s=spec.admission_window_s, seat=seat)
    poster.loop = loop
    loop.start()

    def report_ready() -> None:
        try:
            loop.ready.result()
        except BaseException as exc:
            channel.send(("build_failed", picklable_error(exc)))
            return
        channel.send(("ready", facts[0]))

    threading.Thread(target=report_ready, name="ready", daemon=True).start()
    stopped = threading.Event()

    def beat() -> None:  # the heartbeat the daemon's watchdog reads, while the engine is idle too
        while not stopped.wait(IDLE_TICK_S):
            if loop.ready.done() and loop.engine is not None:
                poster.beat()

    threading.Thread(target=beat, name="beat", daemon=True).start()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the daemon is gone: abort everything and end
            stopped.set()
            loop.stop(5.0)
            return 0
        kind = msg[0]
        if kind == "submit":
            _, rid, ids, params, priority, tenant, arrival = msg
            loop.submit(Submission(rid, ids, params, RemoteSink(rid), priority, tenant, arrival))
        elif kind == "abort":
            loop.abort(msg[1])
        elif kind == "call":
            call_id, fn = msg[1], msg[2]

            def done(fut, call_id=call_id) -> None:
                exc = fut.exception()
                channel.send(("result", call_id, False, picklable_error(exc)) if exc is not None
                             else ("result", call_id, True, fut.result()))

            loop.call(fn).add_done_callback(done)
        elif kind == "window":
            loop.admission_window_s = msg[1]
        elif kind == "stop":
            stopped.set()
            loop.stop(msg[1])  # aborts what is left: those outputs are posted before this returns
            if loop.engine is not None:
                poster.beat()
            channel.send(("stopped",))
            return 0


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[0]))
    try:
        return serve(conn)
    finally:
        conn.close()


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the engine thread is a daemon thread; no interpreter teardown under it

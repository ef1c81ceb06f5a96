"""The engine loop's Protocol: the engine thread and the worker process proxy both satisfy it, so a model's
slot, the admin routes and the benchmarks hold either without knowing which."""

from __future__ import annotations

import asyncio
import inspect
from types import SimpleNamespace

from gpuservd.engine.loop import AnyEngineLoop, EngineLoop
from gpuservd.worker.proxy import WorkerLoop


def _members() -> list[str]:
    return [n for n in dir(AnyEngineLoop) if not n.startswith("_")] + list(AnyEngineLoop.__annotations__)


def test_the_thread_and_the_worker_proxy_are_engine_loops():
    aloop = asyncio.new_event_loop()
    try:
        thread = EngineLoop("m", lambda: None, aloop, lambda deliveries, events: None)
        spec = SimpleNamespace(admission_window_s=0.0, engine=SimpleNamespace(telemetry_ring_size=8))
        worker = WorkerLoop("m", spec, aloop, lambda deliveries, events: None)  # not started: no process
        for loop in (thread, worker):
            assert isinstance(loop, AnyEngineLoop), type(loop).__name__
            assert loop.pid is None and not loop.alive and loop.recent_steps(4) == []
    finally:
        aloop.close()


def test_the_protocols_methods_take_what_both_loops_take():
    """Same parameter names in the same order, so a caller written against the Protocol fits both."""
    for name in _members():
        proto = getattr(AnyEngineLoop, name, None)
        if not inspect.isfunction(proto):
            continue
        want = list(inspect.signature(proto).parameters)
        for cls in (EngineLoop, WorkerLoop):
            got = list(inspect.signature(getattr(cls, name)).parameters)
            assert got == want, (cls.__name__, name, got)

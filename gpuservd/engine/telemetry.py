"""Per-step telemetry: one record per engine step in a bounded ring buffer (step granularity: per-second
aggregates hide the steps that hurt).

The console, /metrics, `gpuserv doctor` and the benchmarks all read these same
records (`StepRecord`, one of the daemon's typed events, gpuservd/events/types.py).
"""

from __future__ import annotations

import threading
from collections import deque

from gpuservd.events.types import StepRecord


class Telemetry:
    """A thread-safe ring of StepRecords plus listeners (the daemon's event stream)."""

    def __init__(self, size: int = 4096):
        self._ring: deque[StepRecord] = deque(maxlen=size)
        self._lock = threading.Lock()
        self._listeners: list = []
        self.num_steps = 0

    def record(self, rec: StepRecord) -> None:
        with self._lock:
            self._ring.append(rec)
            self.num_steps += 1
            listeners = list(self._listeners)
        for fn in listeners:
            fn(rec)

    def recent(self, n: int | None = None) -> list[StepRecord]:
        with self._lock:
            items = list(self._ring)
        return items if n is None else items[-n:]

    def subscribe(self, fn) -> None:
        with self._lock:
            self._listeners.append(fn)

    def unsubscribe(self, fn) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

"""The arbiter's sense of time: reading it, sleeping, and waiting for a turn.

The arbiter never calls `time` directly. Its decisions depend only on when
things happened, so handing it a virtual clock (the tests do: time that stands
still while any engine thread runs and jumps to the next wake-up when all of
them wait) makes every decision exact and independent of how late a loaded
machine wakes a thread.
"""

from __future__ import annotations

import threading
import time


class WallClock:
    """Real time: perf_counter, time.sleep and the condition's own timed wait."""

    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def wait(self, cond: threading.Condition, timeout: float) -> None:
        """Wait on `cond` (its lock held by the caller) until notified or `timeout` seconds pass."""
        cond.wait(timeout)

    def notify_all(self, cond: threading.Condition) -> None:
        """Wake every thread waiting on `cond` (its lock held by the caller)."""
        cond.notify_all()

"""Virtual time for threads, so that tests of timing decisions do not depend on how late a loaded machine
wakes a thread.

Threads that take part (`join()` ... `leave()`) are each running, sleeping until a virtual time, or blocked
on a condition. Time stands still while any of them runs; when none does, it jumps to the earliest wake-up.
Code between two sleeps thus takes no virtual time, and a sleep of 2 ms takes exactly 2 ms. A thread woken by
`notify_all` counts as running until it sleeps or blocks again, so time cannot move past a handoff that is
still being acted on. It implements the arbiter's clock interface (gpuservd/sharing/clock.py).
"""

from __future__ import annotations

import threading

RUN, BLOCKED = "run", "blocked"


class VirtualClock:
    def __init__(self):
        self._lock = threading.Condition()
        self.t = 0.0
        self._state: dict[int, object] = {}  # thread id -> RUN, BLOCKED, or the virtual time it sleeps until
        self._expected = 0  # threads announced (expect) that have not joined yet: they count as running

    def now(self) -> float:
        return self.t

    def expect(self) -> None:
        """A thread about to start will join: until it does, time waits for it."""
        with self._lock:
            self._expected += 1

    def join(self, expected: bool = False) -> None:
        """The calling thread takes part: time waits for it whenever it runs (expected: it was announced)."""
        with self._lock:
            self._state[threading.get_ident()] = RUN
            self._expected -= expected

    def leave(self) -> None:
        with self._lock:
            self._state.pop(threading.get_ident(), None)
            self._advance()

    def sleep(self, seconds: float) -> None:
        me = threading.get_ident()
        with self._lock:
            self._state[me] = self.t + max(0.0, seconds)
            self._advance()
            while self._state[me] is not RUN:
                self._lock.wait()

    def wait(self, cond: threading.Condition, timeout: float) -> None:
        """Block on `cond` (its lock held by the caller). No virtual timeout: only a notify ends the wait; the
        real `timeout` is a safety net against a lost wake-up, after which the caller checks again."""
        me = threading.get_ident()
        with self._lock:
            self._state[me] = BLOCKED
            self._advance()
        cond.wait(timeout)
        with self._lock:
            self._state[me] = RUN

    def notify_all(self, cond: threading.Condition) -> None:
        with self._lock:
            for ident, state in self._state.items():
                if state is BLOCKED:
                    self._state[ident] = RUN
        cond.notify_all()

    def _advance(self) -> None:
        """Lock held: when no participant runs, move time to the earliest wake-up and wake those sleepers."""
        if self._expected or any(s is RUN for s in self._state.values()):
            return
        wakes = [s for s in self._state.values() if s is not BLOCKED]
        if not wakes:
            return  # everyone blocked: only a notify (or the real safety timeout) moves on
        self.t = max(self.t, min(wakes))
        for ident, state in self._state.items():
            if state is not BLOCKED and state <= self.t:
                self._state[ident] = RUN
        self._lock.notify_all()

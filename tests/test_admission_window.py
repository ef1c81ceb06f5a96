"""The admission window of an idle engine (EngineLoop._gather): how long it waits for the rest of a burst.

The loop's clock and condition are replaced by a script of arrival times, so each case runs in no time and
reads the same on any machine: `wait(timeout)` returns at the next scripted arrival if it comes within the
timeout (the request lands in the inbox, as submit() would put it), else the clock moves by the timeout."""

from __future__ import annotations

import asyncio

import pytest

from gpuservd.engine import loop as loop_mod
from gpuservd.engine.loop import BURST_GAP_S, GATHER_GAP_S, EngineLoop
from gpuservd.serving.daemon_config import ServerConfig


class ScriptedArrivals:
    """A Condition whose waits follow a list of arrival times (seconds), with the clock it drives."""

    def __init__(self, loop: EngineLoop, arrivals: list[float]):
        self.loop = loop
        self.now = 0.0
        self.pending = sorted(arrivals)

    def monotonic(self) -> float:
        return self.now

    def wait(self, timeout: float) -> bool:
        if self.pending and self.pending[0] <= self.now + timeout:
            self.now = max(self.now, self.pending.pop(0))
            self.loop._inbox.append(("submit", None))
            return True
        self.now += timeout
        return False


def gather(arrivals: list[float], window_s: float, monkeypatch) -> tuple[int, float]:
    """Requests in the inbox when the window closes (one there at time 0) and when it closed."""
    aloop = asyncio.new_event_loop()
    try:
        engine_loop = EngineLoop("m", lambda: None, aloop, lambda deliveries, events: None,
                                 admission_window_s=window_s)
        script = ScriptedArrivals(engine_loop, arrivals)
        monkeypatch.setattr(loop_mod.time, "monotonic", script.monotonic)
        engine_loop._cond = script
        engine_loop._inbox = [("submit", None)]
        engine_loop._gather()
        return len(engine_loop._inbox), script.now
    finally:
        aloop.close()


# A burst's arrivals after its first, in ms, as the daemon saw 64 streams of the bench's client (the
# requests' arrival times on /admin/events): runs of 0.3-0.6 ms steps with 4.4-4.5 ms pauses between them.
MEASURED_BURST_MS = [0.9, 1.5, 2.1, 2.6, 3.2, 3.7, 4.2, 4.7, 5.2, 5.7, 6.1, 6.5, 6.8, 7.3, 7.9, 8.3, 10.9, 11.3, 12.9, 13.2, 13.6, 13.9, 14.3, 18.7, 19.3, 19.8, 20.1, 20.5, 20.9, 21.2, 21.5, 21.9, 22.3, 26.8, 27.3, 27.7, 28.0, 28.3, 28.7, 29.0, 29.4, 29.8, 30.1, 30.4, 34.9, 35.4, 35.8, 36.3, 36.7, 37.0, 37.4, 37.7, 38.1, 38.4, 42.9, 43.6, 44.0, 44.3, 44.7, 45.1, 45.4, 45.8, 46.2]


def burst_as_measured() -> list[float]:
    return [ms / 1000 for ms in MEASURED_BURST_MS]


def test_a_lone_request_waits_one_short_gap(monkeypatch):
    n, closed = gather([], 0.05, monkeypatch)
    assert n == 1 and closed == pytest.approx(GATHER_GAP_S)


def test_a_burst_with_pauses_between_its_runs_is_gathered_whole(monkeypatch):
    arrivals = burst_as_measured()
    assert max(b - a for a, b in zip(arrivals, arrivals[1:])) > GATHER_GAP_S  # the pauses the old rule stopped at
    n, closed = gather(arrivals, 0.1, monkeypatch)
    assert n == 64
    assert closed == pytest.approx(arrivals[-1] + BURST_GAP_S)  # closes one burst gap after the last arrival
    n, closed = gather(arrivals, 0.05, monkeypatch)  # the default window: the burst is in before it ends
    assert n == 64 and closed == pytest.approx(0.05)


def test_a_late_second_request_does_not_hold_the_first(monkeypatch):
    """Before a second arrival shows a burst, the short gap applies: a request 14 ms behind the first (the
    first stream's connection was set up first) is left to the next step, which is short."""
    n, closed = gather([0.014, 0.0145, 0.015], 0.05, monkeypatch)
    assert n == 1 and closed == pytest.approx(GATHER_GAP_S)


def test_the_window_caps_a_burst_that_keeps_coming(monkeypatch):
    arrivals = [0.001 * i for i in range(1, 500)]  # one a millisecond for half a second
    n, closed = gather(arrivals, 0.05, monkeypatch)
    assert closed == pytest.approx(0.05)
    assert n == 1 + sum(t <= 0.05 for t in arrivals)


def test_the_default_window_covers_a_burst_of_64_streams():
    assert ServerConfig().admission_window_ms == 50.0

"""/metrics rendered ahead of the next scrape, and served when it is at most `max_age_s` old.

A scraper on a fixed period (an endpoint picker every 50 ms, Prometheus every 15 s) asks again about one
period after its last scrape. The render (about 1 ms of CPU with two models, on the event loop's thread,
which competes for the GIL and the cores with the engine threads) is done a little before that moment
instead of inside the scrape: a scrape that finds a body young enough answers with it at once; one that
comes early, late or unexpected renders as before. The render-ahead costs what the scrape's render would
have cost; nothing is rendered for a scraper that stops (one render ahead at most after its last scrape).

How old a served body may be: at most `max_age_s` (server.metrics_max_age_ms, 25 ms by default; 0 renders
at every scrape). The values move once per engine step anyway (the counters and histograms are updated at
a step's end, the gauges read the step's snapshot; vLLM's own gauges likewise), a step being 10-150 ms
here. Events a client can observe are never hidden behind an older body: a request's end (its counters and
request histograms), a refusal, and a model's arrival or departure each bump `Metrics.epoch`, and a body
rendered before the bump is not served. So a client that got its response and then scrapes sees its
request counted. A bump that comes after the render-ahead and before the scrape it was for (requests end
several times a second while streams run) renders again at once on the loop (`stale`), so that this
scrape too finds its body ready instead of rendering it; once per expected scrape, so a flood of refusals
costs at most one extra render a scrape.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

# Render ahead this share of max_age before the scrape is expected: a scrape that comes up to that much early
# still finds the body, and one up to max_age * (1 - LEAD) late too.
LEAD = 0.4
# Scrape times kept for the period's median and the next scrape's due time.
KEEP_SCRAPES = 5
# Periods longer than this are not predicted: a scraper that pauses for minutes gets a fresh render.
MAX_PERIOD_S = 60.0


class ScrapeCache:
    """The body the next scrape will likely get; call `scrape()` on the event loop's thread only."""

    def __init__(self, render: Callable[[], bytes], epoch: Callable[[], int], max_age_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._render = render
        self._epoch = epoch
        self.max_age_s = max_age_s
        self._clock = clock
        self._body: bytes | None = None
        self._rendered_at = 0.0
        self._rendered_epoch = -1
        self._scrapes: list[float] = []  # the last few scrapes' times, for the period and the next one's due time
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop scrapes come on (known from the first)
        self._awaited = False  # a body was rendered ahead and its scrape has not come yet
        self._refresh_queued = False
        self.hits = 0  # scrapes answered with a body rendered ahead (tests and benchmarks read it)

    def scrape(self) -> tuple[bytes, float | None]:
        """(body, its age in seconds when it was rendered ahead, else None: rendered now)."""
        now = self._clock()
        body, age = self._body, now - self._rendered_at
        if body is None or self.max_age_s <= 0 or age > self.max_age_s or self._rendered_epoch != self._epoch():
            body, age = self._fresh(), None
        else:
            self.hits += 1
        self._scrapes = [*self._scrapes[-(KEEP_SCRAPES - 1):], now]
        self._awaited = False
        self._loop = asyncio.get_running_loop()
        self._plan(now)
        return body, age

    def _fresh(self) -> bytes:
        epoch = self._epoch()  # before the render: a bump during it leaves the body older than the bump
        body = self._render()
        self._body, self._rendered_at, self._rendered_epoch = body, self._clock(), epoch
        return body

    def _plan(self, now: float) -> None:
        """Render ahead LEAD * max_age before the next scrape is due. The period is the median of the last
        few (a scrape the daemon handled late makes one period long and the next short); the next scrape is
        due one period after the least delayed of the recent ones, projected forward (a late scrape does not
        move the scraper's own schedule)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        times = self._scrapes
        if self.max_age_s <= 0 or len(times) < 2:
            return
        periods = sorted(b - a for a, b in zip(times, times[1:]))
        period = periods[len(periods) // 2]
        if not 0 < period <= MAX_PERIOD_S:
            return
        due = min(t + (len(times) - i) * period for i, t in enumerate(times))
        # a period shorter than the lead: at once (the body is then about one period old at the next scrape)
        delay = max(0.0, due - LEAD * self.max_age_s - now)
        self._timer = asyncio.get_running_loop().call_at(self._loop_time(now) + delay, self._ahead)

    def _loop_time(self, now: float) -> float:
        """`now` on the event loop's clock (the loop's is time.monotonic too, unless a test gave another)."""
        loop = asyncio.get_running_loop()
        return loop.time() + (now - self._clock())

    def _ahead(self) -> None:
        self._timer = None
        self._fresh()
        self._awaited = True

    def stale(self) -> None:
        """Any thread: the epoch moved (Metrics.on_epoch). A body rendered ahead for a scrape still to come
        is rendered again on the loop now, once per expected scrape."""
        loop = self._loop
        if loop is None or not self._awaited or self._refresh_queued:
            return
        self._refresh_queued = True
        try:
            loop.call_soon_threadsafe(self._refresh)
        except RuntimeError:  # the loop is closed: the daemon is exiting
            pass

    def _refresh(self) -> None:
        self._refresh_queued = False
        if self._awaited and self._rendered_epoch != self._epoch():
            self._awaited = False  # at most one render again before the scrape comes
            self._fresh()

    def close(self) -> None:
        self._awaited = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

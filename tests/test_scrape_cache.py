"""/metrics rendered ahead of the next scrape (api/scrape_cache.py): a scraper on a fixed period gets a body
rendered just before it asked, never one older than server.metrics_max_age_ms, and never one from before
an event a client can observe (a request's end, a refusal, a model's load or unload).

The unit tests drive the cache with a fake clock for its ages and periods; the render-ahead itself runs on
a real event loop's timer (a sleep past its deadline is certain to have run it: the loop runs timers in
deadline order)."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuservd.api.scrape_cache import LEAD, ScrapeCache
from gpuservd.errors import UserError
from gpuservd.serving.daemon_config import daemon_config_from_dict
from inprocess_app import run_in_app
from test_backend_contract import CONFIG, complete, home  # noqa: F401  (the fixture)

MAX_AGE = 0.025
PERIOD = 0.05


class Source:
    """A render that counts its calls and an epoch the test bumps; a clock the test sets."""

    def __init__(self):
        self.renders = 0
        self.epoch = 0
        self.now = 100.0

    def render(self) -> bytes:
        self.renders += 1
        return f"render {self.renders}\n".encode()

    def cache(self, max_age=MAX_AGE) -> ScrapeCache:
        return ScrapeCache(self.render, lambda: self.epoch, max_age, clock=lambda: self.now)


async def _two_scrapes(src: Source, cache: ScrapeCache) -> None:
    """Two scrapes one PERIOD apart (each renders: no period known before the second), then the
    render-ahead planned for the third."""
    assert cache.scrape() == (b"render 1\n", None)
    src.now += PERIOD
    assert cache.scrape() == (b"render 2\n", None)
    src.now += PERIOD - LEAD * MAX_AGE  # the fake time the render-ahead is planned for
    await asyncio.sleep(PERIOD)  # past the timer's deadline on the loop's own clock: it has run
    assert src.renders == 3


def test_a_scrape_on_its_period_gets_the_body_rendered_ahead():
    async def main():
        src = Source()
        cache = src.cache()
        await _two_scrapes(src, cache)
        src.now += LEAD * MAX_AGE  # the third scrape, on time
        body, age = cache.scrape()
        assert body == b"render 3\n" and age == pytest.approx(LEAD * MAX_AGE) and src.renders == 3
        assert cache.hits == 1
        cache.close()

    asyncio.run(main())


def test_a_body_older_than_the_max_age_is_not_served():
    async def main():
        src = Source()
        cache = src.cache()
        await _two_scrapes(src, cache)
        src.now += MAX_AGE * 1.01  # a late scrape
        assert cache.scrape() == (b"render 4\n", None)
        cache.close()

    asyncio.run(main())


@pytest.mark.parametrize("event", ["a request ended", "a refusal", "a model came or went"])
def test_a_body_from_before_an_observable_event_is_not_served(event):
    async def main():
        src = Source()
        cache = src.cache()
        await _two_scrapes(src, cache)
        src.epoch += 1  # what Metrics does on each of those
        src.now += LEAD * MAX_AGE
        assert cache.scrape() == (b"render 4\n", None)
        cache.close()

    asyncio.run(main())


def test_a_scrape_handled_late_does_not_move_the_next_ones_render_ahead():
    """A scraper on a 50 ms schedule whose fourth scrape the daemon handled 15 ms late (more than the lead):
    the render-ahead is still planned for the fifth scrape's time on the schedule, not 50 ms after the late one."""
    async def main():
        src = Source()
        cache = src.cache()
        start = src.now
        for k, late in enumerate((0.0, 0.0, 0.0, 0.015)):
            src.now = start + k * PERIOD + late
            cache.scrape()
        loop = asyncio.get_running_loop()
        planned = cache._timer.when() - loop.time()  # from now (start + 3 * PERIOD + 15 ms) on the loop's clock
        assert planned == pytest.approx(PERIOD - 0.015 - LEAD * MAX_AGE, abs=0.01)  # 30 ms off if it moved
        cache.close()

    asyncio.run(main())


def test_max_age_zero_renders_every_scrape_and_plans_nothing():
    async def main():
        src = Source()
        cache = src.cache(max_age=0.0)
        for i in range(1, 5):
            assert cache.scrape() == (f"render {i}\n".encode(), None)
            assert cache._timer is None
            src.now += PERIOD
        await asyncio.sleep(PERIOD)
        assert src.renders == 4

    asyncio.run(main())


def test_one_render_ahead_at_most_after_the_last_scrape():
    """A scraper that stops costs one render, not one per period."""
    async def main():
        src = Source()
        cache = src.cache()
        await _two_scrapes(src, cache)
        src.now += 10 * PERIOD
        await asyncio.sleep(3 * PERIOD)
        assert src.renders == 3 and cache._timer is None

    asyncio.run(main())


async def _refreshed(src: Source, renders: int) -> None:
    """Let the loop run the refresh that a bump queued from another thread (a few iterations at most)."""
    for _ in range(20):
        if src.renders >= renders:
            return
        await asyncio.sleep(0)


def test_a_bump_after_the_render_ahead_renders_again_before_the_scrape():
    """A request that ends after the render-ahead (the epoch bumped on an engine thread): the body is rendered
    again on the loop at once, and the scrape finds it ready; a second bump before the scrape renders
    nothing more (once per scrape), and the scrape then renders its own."""
    async def main():
        src = Source()
        cache = src.cache()
        await _two_scrapes(src, cache)  # render 3: ahead of the third scrape
        src.epoch += 1
        await asyncio.to_thread(cache.stale)
        await _refreshed(src, 4)
        src.now += LEAD * MAX_AGE
        body, age = cache.scrape()
        assert body == b"render 4\n" and age is not None and src.renders == 4
        src.now += PERIOD - LEAD * MAX_AGE
        await asyncio.sleep(PERIOD)  # render 5, ahead of the fourth
        for _ in range(2):
            src.epoch += 1
            await asyncio.to_thread(cache.stale)
            await _refreshed(src, 7)
        assert src.renders == 6  # one render again, not two
        src.now += LEAD * MAX_AGE
        assert cache.scrape() == (b"render 7\n", None)
        cache.close()

    asyncio.run(main())


def test_a_bump_before_the_render_ahead_costs_no_render():
    async def main():
        src = Source()
        cache = src.cache()
        cache.scrape()
        src.now += PERIOD
        cache.scrape()  # the render-ahead is planned, not yet run
        src.epoch += 1
        await asyncio.to_thread(cache.stale)
        await _refreshed(src, 3)
        assert src.renders == 2  # the planned render-ahead will see the bump
        cache.close()

    asyncio.run(main())


def test_metrics_bumps_tell_the_scrape_cache(home):  # noqa: F811
    """The app wires Metrics.on_epoch to its scrape cache; each kind of bump calls it."""
    from gpuservd.api.metrics import Metrics
    from gpuservd.api.server import build_app

    metrics = Metrics()
    app = build_app(None, metrics, None)
    assert metrics.on_epoch == app.state.scrape_cache.stale
    calls = []
    metrics.on_epoch = lambda: calls.append(metrics.epoch)
    metrics.add_model("m")
    metrics.rejected("queue_full")
    metrics.http_error(404)
    metrics.remove_model("m")
    assert calls == [1, 2, 3, 4]


def test_metrics_max_age_ms_is_checked():
    with pytest.raises(UserError, match="server.metrics_max_age_ms"):
        daemon_config_from_dict({"server": {"metrics_max_age_ms": -1}})
    assert daemon_config_from_dict({}).server.metrics_max_age_ms == 25.0


def _scraped(r) -> tuple[dict, float | None]:
    """The families of a /metrics response and its body's age (None: rendered for this scrape)."""
    parts = dict(item.strip().split(";dur=") for item in r.headers["server-timing"].split(","))
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    return fams, (float(parts["age"]) if "age" in parts else None)


def _successes(fams: dict, model: str) -> float:
    return sum(s.value for s in fams["vllm:request_success"].samples
               if s.name == "vllm:request_success_total" and s.labels["model_name"] == model)


def test_the_daemon_serves_bodies_rendered_ahead_and_a_finished_request_is_in_the_next_scrape(home):  # noqa: F811
    """Through the app: periodic scrapes get bodies rendered ahead (Server-Timing `age`, within the max age);
    a request that ends between a render-ahead and the next scrape is counted in that scrape."""
    period = 0.3  # shorter than LEAD * 1 s: each scrape's render-ahead runs at once, during the sleep

    async def check(client, serving):
        ages = []
        for _ in range(4):
            fams, age = _scraped(await client.get("/metrics"))
            ages.append(age)
            await asyncio.sleep(period)
        assert ages[0] is None  # nothing rendered before
        # later ones: the last render (the previous scrape's, or the render-ahead after it), at most 1 s old (a
        # scrape that a loaded machine delays past that renders its own)
        served = [a for a in ages[1:] if a is not None]
        assert served and all(0 <= a <= 1000 for a in served), ages
        before = _successes(fams, "tiny")
        await complete(client, "tiny")  # ends after the render-ahead planned by the last scrape
        # its end rendered the body again on the loop (ScrapeCache.stale), or this scrape renders it
        fams, age = _scraped(await client.get("/metrics"))
        assert _successes(fams, "tiny") == before + 1
        # the request's histograms came with it
        count = [s.value for s in fams["vllm:e2e_request_latency_seconds"].samples
                 if s.name.endswith("_count") and s.labels["model_name"] == "tiny"]
        assert count == [before + 1]

    run_in_app(check, {**CONFIG, "server": {**CONFIG["server"], "metrics_max_age_ms": 1000}}, load=["tiny"])

"""The models screen's weight-cache panel renders what the daemon reports now, and says what it does not."""

from __future__ import annotations

from console.screens.models import cache_text
from console.widgets import NOT_REPORTED


class FakeState:
    def __init__(self, status, events=()):
        self.status = status
        self._events = list(events)

    def log(self, kind):
        return [e for e in self._events if e.get("type") == kind]


MODEL = {"name": "smollm2", "tiers": {"device": 651306240, "host": 538060032, "host_compression": None},
         "weights_bytes": 651306240, "num_layers": 30, "layers_ready": 30}
CACHE = {"device": {"used_bytes": 651306240, "budget_bytes": 4 << 30, "models": ["smollm2"], "cache_size": 3},
         "host": {"used_bytes": 538060032, "budget_bytes": 2 << 30, "models": ["smollm2"], "compression": "int8"},
         "hit_rate": {"device": 0.75, "host": None}, "policy": "lru", "load_strategy": "layered",
         "prefetch": {"enabled": True, "issued": 4, "used": 3, "accuracy": 0.75}}


def test_weight_cache_and_versions_rendered():
    status = {"models": [MODEL], "weight_cache": CACHE,
              "versions": {"smollm2": {"weights": {"smollm2": 90.0, "smollm2-ft": 10.0}, "served": {"smollm2": 9}}}}
    events = [{"type": "model_load", "model": "smollm2", "phase": "ready", "load_s": 1.5, "tier": "disk-int8",
               "num_layers": 30}]
    text = cache_text(FakeState(status, events), MODEL)
    assert "ready in 1.50 s from the disk-int8 tier, layers 30/30 on the device" in text
    assert "1/3 models" in text and "(int8)" in text and "hit rate: device 75%" in text
    assert "prefetch 3/4 used (75%)" in text
    assert "smollm2 -> smollm2 90% (served 9), smollm2-ft 10% (served 0)" in text
    assert "{" not in text  # no raw dicts


def test_older_daemon_says_not_reported():
    text = cache_text(FakeState({"models": [{"name": "m"}]}), {"name": "m"})
    assert f"weight cache: {NOT_REPORTED}" in text and f"version / canary: {NOT_REPORTED}" in text


def test_keep_alive_says_how_long_an_idle_model_stays_and_when_it_leaves():
    def text(**m):
        return cache_text(FakeState({"models": [MODEL]}), {**MODEL, **m})

    assert "keep alive: 300 s idle, then down a tier; leaves in 42 s" in text(keep_alive_s=300.0, unload_in_s=42.2)
    assert "keep alive: 300 s idle, then down a tier; busy" in text(keep_alive_s=300.0, unload_in_s=None)
    assert "keep alive: forever (never leaves by itself)" in text(keep_alive_s=-1.0, unload_in_s=None)
    assert "keep alive: pinned (never leaves by itself)" in text(keep_alive_s=0.0, pinned=True)
    assert "keep alive" not in cache_text(FakeState({"models": [MODEL]}), MODEL)  # an older daemon: no line

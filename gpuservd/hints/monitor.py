"""The daemon side of the hints: keep a window of the event stream, evaluate the rules once a second.

`observe(event)` is called for every event the daemon publishes (a cheap
append on the event loop thread: step records go to a per-model ring, the
rest to one ring). `evaluate()` builds a Window and runs every rule, once
per model for the per-model ones; it returns the activations and
deactivations as `hint` events (name, model, active, symptom, cause,
action, evidence, since), which the daemon publishes. `/admin/status` lists
the active hints (`hints`) and, per rule, the inputs it has no data from in
this daemon (`hint_rules`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from gpuservd.events.types import Event, Hint
from gpuservd.hints.rule import Rule, Thresholds, missing_inputs
from gpuservd.hints.rules_cache import RULES as CACHE_RULES
from gpuservd.hints.rules_device import RULES as DEVICE_RULES
from gpuservd.hints.rules_sched import RULES as SCHED_RULES
from gpuservd.hints.sweeps import latest_sweep
from gpuservd.hints.window import Window

log = logging.getLogger("gpuservd.hints")

ALL_RULES: list[Rule] = SCHED_RULES + DEVICE_RULES + CACHE_RULES
IGNORED = ("hint", "hello", "dropped", "console")  # our own output, and stream bookkeeping


class HintMonitor:
    """A sliding window over the daemon's events plus the rules' verdicts."""

    def __init__(self, rules: list[Rule] | None = None, thresholds: Thresholds | None = None,
                 max_steps: int = 4096, max_events: int = 20000, period_s: float = 1.0):
        self.rules = list(rules or ALL_RULES)
        self.th = thresholds or Thresholds()
        self.period_s = period_s  # evaluation period in the daemon
        self._max_steps = max_steps
        self._steps: dict[str, deque] = {}
        self._events: deque[dict] = deque(maxlen=max_events)
        self._readings: deque[dict] = deque(maxlen=2048)
        self._cache: deque[dict] = deque(maxlen=2048)
        self.active: dict[tuple[str, str | None], dict] = {}  # (rule, model) -> the hint
        empty = Window(0.0)
        self.missing = {r.name: missing_inputs(r, empty) for r in self.rules}  # from the last evaluation
        self.num_evaluations = 0
        self.last_eval_s = 0.0  # how long the last evaluation took (it must stay cheap)

    # ---- input -------------------------------------------------------------------------------------
    def observe(self, event: Event | dict) -> None:
        """Every published event (a bus tap). The window keeps their JSON form: the rules run over
        recordings of /admin/events too (doctor, tests), and read both alike."""
        if isinstance(event, Event):
            event = event.to_json()
        kind = event.get("type")
        if kind == "step":
            ring = self._steps.get(event["model"])
            if ring is None:
                ring = self._steps[event["model"]] = deque(maxlen=self._max_steps)
            ring.append(event)
        elif kind not in IGNORED:
            self._events.append(event)

    def sample(self, now: float, readings: dict | None = None, weight_cache: dict | None = None) -> None:
        """Device readings and the weight cache's counters, as the daemon's status shows them now."""
        if readings:
            self._readings.append({"t": now, **readings})
        if weight_cache:
            self._cache.append({"t": now, **weight_cache})

    def window(self, now: float, models: dict | None = None, sweeps: dict | None = None) -> Window:
        since = now - max(self.th.event_span_s, self.th.starvation_span_s)
        for ring in (self._events, self._readings, self._cache, *self._steps.values()):
            while ring and ring[0].get("t", now) < since:
                ring.popleft()
        return Window(now, {m: list(r) for m, r in self._steps.items()}, list(self._events), list(self._readings),
                      dict(models or {}), list(self._cache), dict(sweeps or {}))

    # ---- verdicts ----------------------------------------------------------------------------------
    def evaluate(self, now: float | None = None, models: dict | None = None, sweeps: dict | None = None,
                 window: Window | None = None) -> list[Hint]:
        """Run every rule; returns the `hint` events for hints that turned on or off."""
        t0 = time.perf_counter()
        now = time.time() if now is None else now
        w = window or self.window(now, models, sweeps)
        names = sorted(set(w.models) | {m for m, s in w.steps.items() if s}
                       | w.event_models())
        seen: set[tuple[str, str | None]] = set()
        changes = []
        for rule in self.rules:
            self.missing[rule.name] = missing_inputs(rule, w)
            for model in (names if rule.per_model else [None]):
                try:
                    evidence = rule.check(w, model, self.th)
                except Exception:  # a rule must never take the daemon down; say which one failed
                    log.exception("hint rule %s failed on model %s", rule.name, model)
                    continue
                if evidence is None:
                    continue
                key = (rule.name, model)
                seen.add(key)
                hint = self.active.get(key)
                if hint is None:
                    hint = self.active[key] = {"name": rule.name, "model": model, "active": True,
                                               "symptom": rule.symptom, "cause": rule.cause, "since": now}
                    changes.append(hint)
                hint.update(evidence=evidence, action=rule.action_text(evidence), t=now)
        for key in [k for k in self.active if k not in seen]:
            hint = self.active.pop(key)
            changes.append({**hint, "active": False, "t": now})
        self.num_evaluations += 1
        self.last_eval_s = time.perf_counter() - t0
        return [Hint(**{**h, "t": now}) for h in changes]

    def hints(self) -> list[dict]:
        """The active hints, oldest first."""
        return sorted((dict(h) for h in self.active.values()), key=lambda h: (h["since"], h["name"]))

    def rule_status(self) -> list[dict]:
        """Per rule: whether this daemon feeds every input it reads, and what is missing."""
        return [{"name": r.name, "symptom": r.symptom, "fed": not self.missing[r.name],
                 "missing": self.missing[r.name]} for r in self.rules]

    # ---- the daemon --------------------------------------------------------------------------------
    def tick(self, serving) -> list[Hint]:
        """One evaluation against a running Serving: sample its status, run the rules, publish changes."""
        now = time.time()
        # What the rules read of /admin/status, read directly: this runs on the event loop every second,
        # and the whole status (every section, formatted) took milliseconds under load.
        manager = serving.models
        counters = manager.cache.counters()
        cache = {"hits": counters["hits"], "misses": counters["misses"],
                 "device": {"cache_size": manager.cache.config.cache_size}}  # the fields of status.weight_cache
        alert = getattr(getattr(serving.config, "cache", None), "hit_rate_alert", None)
        self.sample(now, manager.sharing.readings, {**cache, "hit_rate_alert": alert} if alert is not None else cache)
        models = {}
        for name, slot in sorted(serving.slots.items()):
            snap = slot.loop.snapshot if slot.loop is not None else None
            models[name] = {"preemption": (snap.preemption if snap else None) or {},
                            "sharing_class": serving.config.sharing.model(name).sharing_class.value,
                            "max_num_seqs": slot.config.scheduler.max_num_seqs}
        changes = self.evaluate(now, models, _sweeps(models))
        for event in changes:
            log.info("hint %s %s%s: %s", event.name, "on" if event.active else "off",
                     f" ({event.model})" if event.model else "", event.evidence)
            serving.bus.publish(event)
        return changes

    async def run(self, serving) -> None:
        """Evaluate every period_s until cancelled (spawned by the daemon)."""
        while True:
            await asyncio.sleep(self.period_s)
            try:
                self.tick(serving)
            except Exception:
                log.exception("hint evaluation failed")


def _sweeps(models: dict) -> dict:
    return {m: s for m in models if (s := latest_sweep(m)) is not None}

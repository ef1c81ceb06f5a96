"""Prefetch: predict the next model from the request history and warm it ahead of demand.

The predictor keeps, per model, decayed counts of which model was asked for
next (transitions) and a decayed request rate. After a request for A, the
models most likely to follow A (probability >= `min_prob`) are warmed: into
the device tier when it has room or holds an idle model that is less likely to
be used soon, else into the host tier. Accuracy = prefetches that served a
request before they were evicted / prefetches issued.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field


@dataclass
class PrefetchStats:
    issued: int = 0  # models warmed ahead of demand
    used: int = 0  # ... that a request then found resident
    wasted: int = 0  # ... evicted before any request used them
    pending: set = field(default_factory=set)  # warmed and not yet used nor evicted

    @property
    def accuracy(self) -> float | None:
        done = self.used + self.wasted
        return self.used / done if done else None

    def to_dict(self) -> dict:
        return {"issued": self.issued, "used": self.used, "wasted": self.wasted, "accuracy": self.accuracy}

    def requested(self, name: str, warmed: bool) -> None:
        """A request for `name` arrived; was the load started ahead of it still resident or under way?"""
        if name in self.pending:
            self.pending.discard(name)
            self.used += warmed
            self.wasted += not warmed


class Predictor:
    """Next-model probabilities from decayed transition counts."""

    def __init__(self, decay: float = 0.995, min_prob: float = 0.2):
        self.decay = decay  # per observation, on the row being updated: old habits fade
        self.min_prob = min_prob
        self.trans: dict[str, dict[str, float]] = {}
        self.rate: dict[str, float] = {}
        self.last: str | None = None
        self._lock = threading.Lock()

    def observe(self, model: str) -> None:
        with self._lock:
            for m in self.rate:
                self.rate[m] *= self.decay
            self.rate[model] = self.rate.get(model, 0.0) + 1.0
            if self.last is not None and self.last != model:  # a switch: repeats say nothing about what follows
                row = self.trans.setdefault(self.last, {})
                for m in row:
                    row[m] *= self.decay
                row[model] = row.get(model, 0.0) + 1.0
            self.last = model

    def next_models(self, model: str | None = None, k: int = 2) -> list[tuple[str, float]]:
        """Up to k (model, probability) likely to be switched to from `model` (default: the last one)."""
        with self._lock:
            row = self.trans.get(model if model is not None else self.last) or {}
            total = sum(row.values())
            if not total:
                return []
            ranked = sorted(((m, c / total) for m, c in row.items()), key=lambda x: -x[1])
            return [(m, p) for m, p in ranked[:k] if p >= self.min_prob]

    def value(self, model: str) -> float:
        """How soon `model` is likely to be needed: its probability after the last model, plus a small
        share of its recent rate (what an eviction for a prefetch weighs)."""
        with self._lock:
            row = self.trans.get(self.last) or {}
            total = sum(row.values()) or 1.0
            rates = sum(self.rate.values()) or 1.0
            return row.get(model, 0.0) / total + 0.1 * self.rate.get(model, 0.0) / rates


class HitRateWatch:
    """The device hit rate over the last `window` model lookups, and when it calls for a sizing alert
    (a cache sized for the traffic's working set keeps the hit rate high).

    `observe` returns the alert (a `cache_hit_rate_low` event's fields) once when the rate falls under
    `alert_below`, and again only after it recovered first; None otherwise."""

    def __init__(self, window: int = 50):
        self.lookups: deque[tuple[str, bool]] = deque(maxlen=window)  # (model, found on the device)
        self.alert_on = False

    def observe(self, name: str, hit: bool, alert_below: float, cache_size: int) -> dict | None:
        self.lookups.append((name, hit))
        if len(self.lookups) < (self.lookups.maxlen or 0):
            return None
        rate = sum(h for _, h in self.lookups) / len(self.lookups)
        if rate >= alert_below:
            self.alert_on = False
            return None
        if self.alert_on:
            return None
        self.alert_on = True
        counts: dict[str, int] = {}
        for m, _ in self.lookups:
            counts[m] = counts.get(m, 0) + 1
        need, covered = 0, 0
        for c in sorted(counts.values(), reverse=True):  # models that carry 90% of the requests
            need, covered = need + 1, covered + c
            if covered >= 0.9 * len(self.lookups):
                break
        suggestion = (f"the device hit rate is {100 * rate:.0f}% over the last {len(self.lookups)} requests "
                      f"(alert below {100 * alert_below:.0f}%); {need} models carry 90% of them and "
                      f"cache.cache_size is {cache_size}: raise cache_size to {max(need, cache_size + 1)} "
                      "(with the device bytes to match), pin the busiest models, or turn prefetch on")
        return {"hit_rate": rate, "window": len(self.lookups), "models_for_90pct": need, "cache_size": cache_size,
                "suggested_cache_size": max(need, cache_size + 1), "message": suggestion}

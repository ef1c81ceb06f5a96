"""What a rule looks at: a sliding window of step records, events and device readings.

Everything is plain dicts, exactly as the daemon publishes them on
/admin/events (`StepRecord.to_dict()`, `request_finished`, `preemption`, ...),
so a test builds a window by hand and the daemon builds it from its own stream.
No torch here: the CLI and doctor import this package too.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field

from gpuservd.engine.preemption import percentile


@dataclass
class Window:
    """One evaluation's view of the recent past (times are wall-clock, time.time())."""

    now: float  # when the window ends
    steps: dict[str, list[dict]] = field(default_factory=dict)  # model -> step records, oldest first
    events: list[dict] = field(default_factory=list)  # non-step events, oldest first (each has "type", "t")
    readings: list[dict] = field(default_factory=list)  # samples of status.device.readings, each with "t"
    models: dict[str, dict] = field(default_factory=dict)  # model -> settings: max_num_seqs, preemption, class
    weight_cache: list[dict] = field(default_factory=list)  # samples of status.weight_cache, each with "t"
    sweeps: dict[str, dict] = field(default_factory=dict)  # model -> latest `gpuserv bench sweep` result
    _memo: dict = field(default_factory=dict, repr=False)  # (model, span) -> recent steps: rules share the scans

    def recent_steps(self, model: str, span_s: float) -> list[dict]:
        """The model's step records that ended within the last span_s seconds (oldest first)."""
        key = (model, span_s)
        if key not in self._memo:
            since = self.now - span_s
            steps = self.steps.get(model, ())
            i = len(steps)
            while i > 0 and steps[i - 1]["t"] >= since:  # newest last: walk back only over the span
                i -= 1
            self._memo[key] = list(steps[i:])
        return self._memo[key]

    def of_type(self, kind: str) -> list[dict]:
        """The events of one type, oldest first. The daemon's window holds up to 20000 events (the arbiter
        publishes one per time slice), and the evaluation runs on the event loop every second: the events
        are sorted by type in one pass that every rule shares, not scanned once per rule."""
        index = self._memo.get("by_type")
        if index is None:
            index, models = {}, set()
            for e in self.events:
                index.setdefault(e.get("type"), []).append(e)
                if e.get("model"):
                    models.add(e["model"])
            self._memo["by_type"], self._memo["event_models"] = index, models
        return index.get(kind, [])

    def event_models(self) -> set[str]:
        """The models the events name."""
        self.of_type("")
        return self._memo["event_models"]

    def recent_events(self, kinds: str | tuple[str, ...], span_s: float, model: str | None = None) -> list[dict]:
        """Events of these types within the last span_s seconds (of one model when given), oldest first."""
        kinds = (kinds,) if isinstance(kinds, str) else kinds
        since = self.now - span_s
        lists = [self.of_type(k) for k in dict.fromkeys(kinds)]
        events = lists[0] if len(lists) == 1 else heapq.merge(*lists, key=lambda e: e.get("t", 0))
        return [e for e in events if e.get("t", 0) >= since and (model is None or e.get("model") == model)]

    def recent_readings(self, span_s: float) -> list[dict]:
        since = self.now - span_s
        return [r for r in self.readings if r.get("t", 0) >= since]


def pct(values, q: float) -> float:
    """Nearest-rank percentile of unsorted values (the engine's auto mode uses the same)."""
    return percentile(sorted(values), q)


def mean(values) -> float:
    values = list(values)
    return statistics.fmean(values) if values else 0.0


def r3(x: float) -> float:
    """Evidence numbers are rounded so that a hint reads well and compares stably."""
    return round(float(x), 3)

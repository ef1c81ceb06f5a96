"""Prometheus text exposition of the daemon's metrics, cheap enough to scrape every 50 ms.

prometheus_client's `generate_latest` rebuilds, re-validates and re-escapes
every label set of every sample on every scrape: with two models that is ~800
lines and several milliseconds of CPU taken from the event loop that also
streams tokens. Here the text before each value ("name{labels} ") is built
once per series and kept; a scrape reads the current values and joins strings.

The counters and histograms stay prometheus_client's own objects (thread-safe
updates from the engine threads); this module reads their children's values
(`_metrics`, `_value`, `_buckets`, `_sum`: the attributes prometheus_client's
own `collect` reads). Families from custom collectors (the scrape-time gauges)
are formatted sample by sample. A test checks that the text parses to exactly
the families `generate_latest` gives.
"""

from __future__ import annotations

import math

from prometheus_client import Counter, Histogram
from prometheus_client.utils import floatToGoString


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_value(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(pairs) -> str:
    """`{a="x",b="y"}` with the names sorted, as prometheus_client writes them; "" without labels."""
    items = sorted(pairs)
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape_value(str(v))}"' for k, v in items) + "}"


def _num(value: float) -> str:
    """A sample value; integers (most counts) skip the general float formatting."""
    if value.is_integer() and abs(value) < 1e15:
        return f"{int(value)}.0"
    if math.isfinite(value):
        return repr(value)
    return floatToGoString(value)


class Exposition:
    """Renders `metrics` (prometheus_client Counters and Histograms, in order) then `collectors`' families."""

    def __init__(self, metrics: list, collectors: list):
        self.metrics = metrics
        self.collectors = collectors
        self._heads = {id(m): self._head(m) for m in metrics}
        self._prefixes: dict[tuple[int, tuple], tuple[str, ...]] = {}  # (metric, label values) -> line starts
        # (histogram, label values) -> (bucket counts and sum, their text): an idle series is not reformatted
        self._last: dict[tuple[int, tuple], tuple[tuple, str]] = {}

    @staticmethod
    def _head(metric) -> str:
        counter = isinstance(metric, Counter)
        name = metric._name + "_total" if counter else metric._name  # the text format names a counter so
        kind = "counter" if counter else "histogram"
        return f"# HELP {name} {_escape_help(metric._documentation)}\n# TYPE {name} {kind}\n"

    def _series_prefixes(self, metric, labelvalues: tuple) -> tuple[str, ...]:
        key = (id(metric), labelvalues)
        prefixes = self._prefixes.get(key)
        if prefixes is None:
            base = list(zip(metric._labelnames, labelvalues))
            name = metric._name
            if isinstance(metric, Counter):
                prefixes = (f"{name}_total{_labels(base)} ",)
            else:
                prefixes = tuple(f"{name}_bucket{_labels(base + [('le', floatToGoString(b))])} "
                                 for b in metric._upper_bounds)
                prefixes += (f"{name}_count{_labels(base)} ", f"{name}_sum{_labels(base)} ")
            self._prefixes[key] = prefixes
        return prefixes

    def forget(self, metric, labelvalues: tuple) -> None:
        """A series was removed: drop its cached text."""
        self._prefixes.pop((id(metric), labelvalues), None)
        self._last.pop((id(metric), labelvalues), None)

    def render(self) -> bytes:
        out: list[str] = []
        for metric in self.metrics:
            out.append(self._heads[id(metric)])
            with metric._lock:
                children = list(metric._metrics.items())
            histogram = isinstance(metric, Histogram)
            for labelvalues, child in children:
                prefixes = self._series_prefixes(metric, labelvalues)
                if not histogram:
                    out.append(f"{prefixes[0]}{_num(child._value.get())}\n")
                    continue
                out.append(self._histogram(metric, labelvalues, child, prefixes))
        for collector in self.collectors:
            for family in collector.collect():
                out.append(self._family(family))
        return "".join(out).encode()

    def _histogram(self, metric, labelvalues: tuple, child, prefixes: tuple[str, ...]) -> str:
        state = (*[b.get() for b in child._buckets], child._sum.get())
        key = (id(metric), labelvalues)
        last = self._last.get(key)
        if last is not None and last[0] == state:
            return last[1]
        lines, acc = [], 0.0
        for prefix, count in zip(prefixes[:-2], state[:-1]):
            acc += count
            lines.append(f"{prefix}{_num(acc)}\n")
        lines.append(f"{prefixes[-2]}{_num(acc)}\n{prefixes[-1]}{_num(state[-1])}\n")
        text = "".join(lines)
        self._last[key] = (state, text)
        return text

    @staticmethod
    def _family(family) -> str:
        name = family.name + "_total" if family.type == "counter" else family.name
        lines = [f"# HELP {name} {_escape_help(family.documentation)}\n# TYPE {name} {family.type}\n"]
        for s in family.samples:
            lines.append(f"{s.name}{_labels(s.labels.items())} {_num(float(s.value))}\n")
        return "".join(lines)

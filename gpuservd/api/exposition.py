"""Prometheus text exposition of the daemon's metrics, cheap enough to scrape every 50 ms.

prometheus_client's `generate_latest` rebuilds, re-validates and re-escapes
every label set of every sample on every scrape: with two models that is ~800
lines and several milliseconds of CPU taken from the event loop that also
streams tokens. Here the text before each value ("name{labels} ") is built
once per series and kept; a scrape reads the current values and joins strings.

The counters and histograms stay prometheus_client's own objects (thread-safe
updates from the engine threads); this module reads their children's values
(`_metrics`, `_value`, `_buckets`, `_sum`: the attributes prometheus_client's
own `collect` reads) without taking each value's lock: a float attribute is
read whole under the GIL, and a scrape that lands mid-update sees the bucket
before or after the observation exactly as with the locks (each value was
locked on its own, never the histogram as a whole). The scrape-time gauges
come as rows (api/metrics_gauges.py `Family`), whose line prefixes are kept
per series as well. A test checks that the text parses to exactly the
families `generate_latest` gives.

Nothing is cached but text: every value is read at the scrape.
"""

from __future__ import annotations

import math

from prometheus_client import Counter, Histogram, values
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


ROW_PREFIXES_MAX = 4096


def _read(value) -> float:
    """A prometheus_client value's float without its lock (see the module docstring); the locked getter
    for value classes that keep it elsewhere (multiprocess mode)."""
    raw = getattr(value, "_value", None)
    return raw if isinstance(raw, float) else value.get()


# prometheus_client keeps each value as a float attribute `_value` unless it runs in multiprocess mode
_PLAIN_VALUES = values.ValueClass is values.MutexValue


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
        # (family name, label values) -> "name{labels} " of a scrape-time gauge's series; bounded: label values
        # come and go with models (and the variant list is itself a label), so it is emptied when it grows
        self._row_prefixes: dict[tuple[str, tuple], str] = {}
        self._family_heads: dict[tuple[str, str, str], tuple[str, str]] = {}  # a gauge family's name and head

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
                    out.append(f"{prefixes[0]}{_num(_read(child._value))}\n")
                    continue
                out.append(self._histogram(metric, labelvalues, child, prefixes))
        if len(self._row_prefixes) > ROW_PREFIXES_MAX:
            self._row_prefixes.clear()
        if len(self._family_heads) > ROW_PREFIXES_MAX:  # only if a family's help text were ever made per scrape
            self._family_heads.clear()
        for collector in self.collectors:
            for family in collector.families():
                out.append(self._family(family))
        return "".join(out).encode()

    def _histogram(self, metric, labelvalues: tuple, child, prefixes: tuple[str, ...]) -> str:
        if _PLAIN_VALUES:  # the attribute itself: a histogram has ~20 of them, read on every scrape
            state = (*[b._value for b in child._buckets], child._sum._value)
        else:
            state = (*[_read(b) for b in child._buckets], _read(child._sum))
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

    def _family(self, family) -> str:
        """A metric_gauges.Family: its head, then one line per row."""
        head = self._family_heads.get((family.name, family.type, family.doc))
        if head is None:  # a fixed set: the families are named in code
            counter = family.type == "counter"
            name = family.name + "_total" if counter else family.name
            head = (name, f"# HELP {name} {_escape_help(family.doc)}\n# TYPE {name} {family.type}\n")
            self._family_heads[(family.name, family.type, family.doc)] = head
        name, lines = head[0], [head[1]]
        prefixes, names = self._row_prefixes, family.labelnames
        for labelvalues, value in family.rows:
            key = (name, labelvalues)
            prefix = prefixes.get(key)
            if prefix is None:
                prefix = prefixes[key] = f"{name}{_labels(zip(names, labelvalues))} "
            lines.append(f"{prefix}{_num(float(value))}\n")
        return "".join(lines)

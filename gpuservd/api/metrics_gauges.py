"""Gauges read at scrape time from Serving and the engine loops' snapshots (the /metrics collector).

The endpoint picker of the Gateway API inference extension (what KServe and
Envoy AI Gateway use for self-hosted models) reads the FIRST series of
`vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` and `vllm:cache_config_info`. A daemon hosts several
models, so each of those families starts with one series without labels: the
daemon's total (in PromQL `{model_name=""}`), followed by one series per model
(`{model_name="..."}`; vLLM's own dashboards select those). Waiting counts the
requests queued in an engine plus those waiting for their model's load.

`vllm:lora_requests_info` describes the derived variants (fine-tunes that run
on a loaded base's weights, the nearest thing to vLLM's LoRA adapters):
running = variants on the device, ready to serve; waiting = variants that
requests are waiting to have loaded; max_lora = how many models the device
cache holds (cache.cache_size). Its value is the scrape time, as the picker
takes the series with the largest value.

The families are plain rows (`Family`): /metrics renders them directly
(api/exposition.py keeps each series' line prefix), and `collect()` turns them
into prometheus_client's families for its registry and parser.
"""

from __future__ import annotations

import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gpuservd import __version__

MODEL = ["model_name"]


class Family:
    """One metric family read at scrape time: (label values, value) rows. Label values pair with the
    leading label names (a row may leave trailing names out, as prometheus_client's add_metric allows)."""

    __slots__ = ("name", "doc", "type", "labelnames", "rows")

    def __init__(self, name: str, doc: str, labelnames, kind: str = "gauge"):
        self.name = name
        self.doc = doc
        self.type = kind  # gauge | counter
        self.labelnames = tuple(labelnames)
        self.rows: list[tuple[tuple, float]] = []

    def add_metric(self, labelvalues, value: float) -> None:
        self.rows.append((tuple(labelvalues), value))

    def to_prometheus(self):
        cls = GaugeMetricFamily if self.type == "gauge" else CounterMetricFamily
        fam = cls(self.name, self.doc, labels=self.labelnames)
        for labelvalues, value in self.rows:
            fam.add_metric(labelvalues, value)
        return fam


def _gauge(name: str, doc: str, labels=MODEL) -> Family:
    return Family(name, doc, labels)


def _counter(name: str, doc: str, labels=()) -> Family:
    return Family(name, doc, labels, "counter")


class GaugeCollector:
    """A prometheus_client collector over `metrics.serving` (None until the daemon made it)."""

    def __init__(self, metrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        for family in self.families():
            yield family.to_prometheus()

    def families(self):
        """The families as rows (what /metrics renders)."""
        info = _gauge("gpuserv_build_info", "Version of the daemon", ["version"])
        info.add_metric([__version__], 1)
        yield info
        serving = self.metrics.serving
        if serving is None:
            return
        slots = list(serving.slots.items())
        yield from _load_gauges(serving, slots)
        yield from _model_gauges(slots)
        yield from _daemon_gauges(serving)
        yield from _cache_metrics(serving.cache)
        yield from _hint_gauges(serving.hints)
        yield from _sharing_metrics(serving.sharing.metric_rows())


def _load_gauges(serving, slots):
    """The families a router or endpoint picker reads: the daemon's total first, then each model's."""
    running = _gauge("vllm:num_requests_running", "Requests in an engine's batch")
    waiting = _gauge("vllm:num_requests_waiting", "Requests queued in an engine or waiting for their model's load")
    swapped = _gauge("vllm:num_requests_swapped", "Preempted requests whose KV is in host memory")
    usage = _gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)")
    gpu_usage = _gauge("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full); vLLM's older name")
    # model_name last: the daemon's series leaves it out (add_metric pairs the values with the leading names)
    cache_info = _gauge("vllm:cache_config_info", "KV cache layout: tokens per block and blocks on the device",
                        ["block_size", "num_gpu_blocks", "enable_prefix_caching"] + MODEL)
    load_waiters = dict(serving.models.load_waiters)
    rows = []  # (model, running, waiting, swapped, used blocks, total blocks)
    for name, slot in slots:
        s = slot.loop.snapshot if slot.loop is not None else None
        if s is None and not load_waiters.get(name):
            continue
        if s is None:
            rows.append((name, 0, load_waiters[name], 0, 0, 0))
            continue
        rows.append((name, s.num_running, s.num_waiting + load_waiters.get(name, 0),
                     (s.preemption or {}).get("num_swapped", 0), s.kv_blocks_used, s.kv_blocks_total))
    in_slots = {name for name, _ in slots}
    rows.extend((name, 0, n, 0, 0, 0) for name, n in load_waiters.items() if n and name not in in_slots)
    engine = serving.config.engine
    layout = [str(engine.block_size), "", str(engine.prefix_caching)]
    totals = [sum(r[i] for r in rows) for i in range(1, 6)]
    for label, row in [([], ("", *totals))] + [([r[0]], r) for r in rows]:
        _, num_running, num_waiting, num_swapped, blocks_used, blocks_total = row
        frac = blocks_used / blocks_total if blocks_total else 0.0
        running.add_metric(label, num_running)
        waiting.add_metric(label, num_waiting)
        swapped.add_metric(label, num_swapped)
        usage.add_metric(label, frac)
        gpu_usage.add_metric(label, frac)
        if blocks_total or not label:
            layout[1] = str(blocks_total)
            cache_info.add_metric(layout + label, 1)
    yield from (running, waiting, swapped, usage, gpu_usage, cache_info)
    yield _variant_info(serving, slots, load_waiters)


def _variant_info(serving, slots, load_waiters) -> GaugeMetricFamily:
    lora = _gauge("vllm:lora_requests_info", "Derived variants on the device (running) and waited for (waiting)",
                  ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    ready = sorted(name for name, slot in slots if slot.base and slot.state == "ready")
    waited = sorted(name for name, slot in slots if slot.base and slot.state == "loading" and load_waiters.get(name))
    lora.add_metric([str(serving.config.cache.cache_size), ",".join(ready), ",".join(waited)], time.time())
    return lora


def _model_gauges(slots):
    """gpuserv's own per-model gauges."""
    blocks = _gauge("gpuserv_kv_blocks", "KV blocks by state", MODEL + ["state"])
    in_flight = _gauge("gpuserv_requests_in_flight", "Admitted, unanswered requests")
    queued = _gauge("gpuserv_requests_queued", "Admitted requests without a first token")
    state = _gauge("gpuserv_model_state", "1 for the model's current state", MODEL + ["state"])
    beat = _gauge("gpuserv_engine_heartbeat_age_seconds", "Since the engine loop last iterated")
    errors = _counter("gpuserv_engine_errors", "Engine steps that raised", MODEL)
    now = time.monotonic()
    for name, slot in slots:
        state.add_metric([name, slot.state], 1)
        in_flight.add_metric([name], slot.num_in_flight)
        queued.add_metric([name], slot.num_queued)
        if slot.loop is None:
            continue
        s = slot.loop.snapshot
        blocks.add_metric([name, "used"], s.kv_blocks_used)
        reserved = (s.preemption or {}).get("kv_blocks_reserved", 0)
        blocks.add_metric([name, "free"], s.kv_blocks_total - s.kv_blocks_used - reserved)
        blocks.add_metric([name, "reserved"], reserved)  # free, kept for pinned requests' growth
        beat.add_metric([name], now - s.heartbeat)
        errors.add_metric([name], s.num_engine_errors)
    yield from (blocks, in_flight, queued, state, beat, errors)


def _daemon_gauges(serving):
    draining = _gauge("gpuserv_draining", "1 while the daemon drains", [])
    draining.add_metric([], 1 if serving.state == "draining" else 0)
    uptime = _gauge("gpuserv_uptime_seconds", "Since the daemon started", [])
    uptime.add_metric([], time.monotonic() - serving.started)
    subs = _gauge("gpuserv_event_subscribers", "Readers of /admin/events", [])
    subs.add_metric([], serving.bus.num_subscribers)
    dropped = _counter("gpuserv_events_dropped", "Events a slow /admin/events reader lost")
    dropped.add_metric([], serving.bus.num_dropped)
    yield from (draining, uptime, subs, dropped)


def _cache_metrics(cache):
    """The weight cache: lookups that found their model per tier, bytes resident per tier."""
    hits = _counter("gpuserv_weight_cache_hits", "Model lookups that found the model in the tier", ["tier"])
    misses = _counter("gpuserv_weight_cache_misses", "Model lookups that did not", ["tier"])
    resident = _gauge("gpuserv_weight_cache_bytes", "Weight bytes held by the tier", ["tier"])
    st = cache.counters()
    for tier in ("device", "host"):
        hits.add_metric([tier], st["hits"][tier])
        misses.add_metric([tier], st["misses"][tier])
        resident.add_metric([tier], st["used_bytes"][tier])
    return hits, misses, resident


def _hint_gauges(monitor):
    """1 while a hint with this name is active (any model); `fed` 0 when this daemon has no data for the rule."""
    active = _gauge("gpuserv_hint_active", "1 while a troubleshooting hint is active", ["name"])
    fed = _gauge("gpuserv_hint_fed", "1 when the daemon feeds every input the hint rule reads", ["name"])
    on = {h["name"] for h in monitor.hints()}
    for rule in monitor.rule_status():
        active.add_metric([rule["name"]], 1 if rule["name"] in on else 0)
        fed.add_metric([rule["name"]], 1 if rule["fed"] else 0)
    yield from (active, fed)


def _sharing_metrics(st: dict):
    """SharingManager.metric_rows(): the arbiter (time slices, bandwidth priority) and memory quotas, per model; no arbiter series when off."""
    arb = st["arbiter"]
    if arb.get("enabled"):
        run = _counter("gpuserv_arbiter_run_seconds", "Time the model held its SM group", MODEL)
        wait = _counter("gpuserv_arbiter_wait_seconds", "Time the model waited for its turn", MODEL)
        slices = _counter("gpuserv_arbiter_slices", "Time slices the model held", MODEL)
        duty = _gauge("gpuserv_arbiter_duty", "Bandwidth-priority duty cycle (1 = not throttled)")
        usage = _gauge("gpuserv_arbiter_usage", "Recent share of time holding the group (~5 s average)")
        for name, x in arb["models"].items():
            run.add_metric([name], x["run_s"])
            wait.add_metric([name], x["wait_s"])
            slices.add_metric([name], x["num_slices"])
            duty.add_metric([name], x["duty"])
            usage.add_metric([name], x["usage"])
        switch = _counter("gpuserv_arbiter_switch_seconds", "Time spent handing groups over")
        switch.add_metric([], arb["switch_s"])
        yield from (run, wait, slices, duty, usage, switch)
    quota = _gauge("gpuserv_memory_quota_bytes", "The model's memory quota")
    used = _gauge("gpuserv_memory_quota_used_bytes", "Weights + KV in use + activations + overhead")
    for name, q in st["quotas"].items():
        quota.add_metric([name], q["quota"])
        if q.get("used_bytes") is not None:
            used.add_metric([name], q["used_bytes"])
    yield from (quota, used)

"""Prometheus metrics (GET /metrics), named as vLLM names them where the meaning is the same.

vLLM's names (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, ...) let
existing dashboards and routers read us unchanged; everything else is
`gpuserv_*`. Every series has a `model_name` label. Gauges are read from the
engine loops' snapshots at scrape time; counters and histograms are updated
by the engine threads (`on_step`) and the HTTP layer (`rejected`).
"""

from __future__ import annotations

import time

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gpuservd import __version__

prometheus_client.disable_created_metrics()  # no *_created series: vLLM exposes none either

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# vLLM's buckets, so the histograms line up on a shared dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)


class Metrics:
    """The daemon's registry; `serving` is read at scrape time for gauges."""

    def __init__(self):
        self.serving = None  # set by the daemon once Serving exists
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", m + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (from HTTP arrival)", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token of a request", m,
                              buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens", m,
                             buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.step = Histogram("gpuserv_step_duration_seconds", "Engine step wall time (schedule+forward+sample)", m,
                              buckets=STEP_BUCKETS, registry=r)
        self.decision = Histogram("gpuserv_scheduler_decision_seconds", "Scheduler decision time per step", m,
                                  buckets=STEP_BUCKETS, registry=r)
        self.preemptions_by_kind = Counter("gpuserv_preemptions", "Preemptions by how the KV left and why",
                                           m + ["kind", "reason"], registry=r)
        self.swap_bytes = Counter("gpuserv_kv_swap_bytes", "KV bytes copied between the device and host pools",
                                  m + ["direction"], registry=r)
        self.swap_seconds = Counter("gpuserv_kv_swap_seconds", "Time spent copying KV to and from the host pool",
                                    m + ["direction"], registry=r)
        self.recomputed_tokens = Counter("gpuserv_preemption_recompute_tokens",
                                         "Tokens whose KV was dropped by a preemption and must be prefilled again",
                                         m, registry=r)
        # Tokens, as vLLM counts them: each admitted request's known tokens are a query, the cached ones hits.
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache: tokens looked up", m, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache: tokens found cached", m, registry=r)
        self.rejections = Counter("gpuserv_requests_rejected", "Requests refused before reaching an engine",
                                  ["reason"], registry=r)
        self.http_errors = Counter("gpuserv_http_errors", "Error responses", ["status"], registry=r)
        self._last_token: dict[tuple[str, str], float] = {}  # (model, request_id) -> monotonic, engine threads
        self.registry.register(_SnapshotCollector(self))

    def add_model(self, model: str) -> None:
        """Create the model's series at zero, so dashboards see them before the first request."""
        for metric in (self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.itl,
                       self.e2e, self.step, self.decision, self.recomputed_tokens, self.prefix_queries,
                       self.prefix_hits):
            metric.labels(model)
        for direction in ("out", "in"):
            self.swap_bytes.labels(model, direction)
            self.swap_seconds.labels(model, direction)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model, reason)

    def on_step(self, model: str, rec, outputs: list) -> None:
        """Engine thread: one step's record and outputs."""
        self.step.labels(model).observe(rec.wall_s)
        self.decision.labels(model).observe(rec.decision_s)
        if rec.num_preempted:
            self.preemptions.labels(model).inc(rec.num_preempted)
            for p in rec.preemptions:
                self.preemptions_by_kind.labels(model, p["kind"], p["reason"]).inc()
                if p["tokens_to_recompute"]:
                    self.recomputed_tokens.labels(model).inc(p["tokens_to_recompute"])
        if rec.num_prefix_query_tokens:
            self.prefix_queries.labels(model).inc(rec.num_prefix_query_tokens)
            self.prefix_hits.labels(model).inc(rec.num_prefix_hit_tokens)
        for m in rec.swaps:
            direction = m["kind"].removeprefix("swap_")
            self.swap_bytes.labels(model, direction).inc(m["bytes_moved"])
            self.swap_seconds.labels(model, direction).inc(m["seconds"])
        now = time.monotonic()
        generated = 0
        for out in outputs:
            key = (model, out.request_id)
            if out.new_token_ids:
                generated += len(out.new_token_ids)
                if out.num_output_tokens == 1:  # prefill done: its prompt was processed
                    self.prompt_tokens.labels(model).inc(out.num_prompt_tokens)
                else:
                    last = self._last_token.get(key)
                    if last is not None:
                        self.itl.labels(model).observe(now - last)
                self._last_token[key] = now
            if out.finished:
                self._finished(model, out)
                self._last_token.pop(key, None)
        if generated:
            self.generation_tokens.labels(model).inc(generated)

    def on_abort(self, model: str, out) -> None:
        """Engine thread: a request was aborted (client gone, cancel, drain)."""
        self._last_token.pop((model, out.request_id), None)
        self._finished(model, out)

    def _finished(self, model: str, out) -> None:
        reason = out.finish_reason.value if out.finish_reason else "unknown"
        self.success.labels(model, reason).inc()
        if out.finish_time is not None:
            self.e2e.labels(model).observe(out.finish_time - out.arrival_time)
        if out.first_token_time is not None:
            self.ttft.labels(model).observe(out.first_token_time - out.arrival_time)
            if out.num_output_tokens > 1 and out.finish_time is not None:
                self.tpot.labels(model).observe((out.finish_time - out.first_token_time) / (out.num_output_tokens - 1))

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class _SnapshotCollector:
    """Gauges read at scrape time from Serving and the engine loops' snapshots."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        serving = self.metrics.serving
        m = ["model_name"]
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in the engine's batch", labels=m)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting in the engine's queue", labels=m)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", labels=m)
        gpu_usage = GaugeMetricFamily("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full); vLLM's older name",
                                      labels=m)
        blocks = GaugeMetricFamily("gpuserv_kv_blocks", "KV blocks by state", labels=m + ["state"])
        in_flight = GaugeMetricFamily("gpuserv_requests_in_flight", "Admitted, unanswered requests", labels=m)
        queued = GaugeMetricFamily("gpuserv_requests_queued", "Admitted requests without a first token", labels=m)
        state = GaugeMetricFamily("gpuserv_model_state", "1 for the model's current state", labels=m + ["state"])
        beat = GaugeMetricFamily("gpuserv_engine_heartbeat_age_seconds", "Since the engine loop last iterated",
                                 labels=m)
        errors = CounterMetricFamily("gpuserv_engine_errors", "Engine steps that raised", labels=m)
        info = GaugeMetricFamily("gpuserv_build_info", "Version of the daemon", labels=["version"])
        info.add_metric([__version__], 1)
        yield info
        if serving is None:
            return
        now = time.monotonic()
        for name, slot in list(serving.slots.items()):
            state.add_metric([name, slot.state], 1)
            in_flight.add_metric([name], slot.num_in_flight)
            queued.add_metric([name], slot.num_queued)
            if slot.loop is None:
                continue
            s = slot.loop.snapshot
            running.add_metric([name], s.num_running)
            waiting.add_metric([name], s.num_waiting)
            frac = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
            usage.add_metric([name], frac)
            gpu_usage.add_metric([name], frac)
            blocks.add_metric([name, "used"], s.kv_blocks_used)
            reserved = (s.preemption or {}).get("kv_blocks_reserved", 0)
            blocks.add_metric([name, "free"], s.kv_blocks_total - s.kv_blocks_used - reserved)
            blocks.add_metric([name, "reserved"], reserved)  # free, kept for pinned requests' growth
            beat.add_metric([name], now - s.heartbeat)
            errors.add_metric([name], s.num_engine_errors)
        yield from (running, waiting, usage, gpu_usage, blocks, in_flight, queued, state, beat, errors)
        draining = GaugeMetricFamily("gpuserv_draining", "1 while the daemon drains")
        draining.add_metric([], 1 if serving.state == "draining" else 0)
        uptime = GaugeMetricFamily("gpuserv_uptime_seconds", "Since the daemon started")
        uptime.add_metric([], now - serving.started)
        subs = GaugeMetricFamily("gpuserv_event_subscribers", "Readers of /admin/events")
        subs.add_metric([], serving.bus.num_subscribers)
        dropped = CounterMetricFamily("gpuserv_events_dropped", "Events a slow /admin/events reader lost")
        dropped.add_metric([], serving.bus.num_dropped)
        yield from (draining, uptime, subs, dropped)
        yield from _cache_metrics(serving.cache)
        yield from _hint_gauges(serving.hints)
        yield from _sharing_metrics(serving.sharing.status())


def _cache_metrics(cache):
    """The weight cache: lookups that found their model per tier, bytes resident per tier."""
    hits = CounterMetricFamily("gpuserv_weight_cache_hits", "Model lookups that found the model in the tier",
                               labels=["tier"])
    misses = CounterMetricFamily("gpuserv_weight_cache_misses", "Model lookups that did not", labels=["tier"])
    resident = GaugeMetricFamily("gpuserv_weight_cache_bytes", "Weight bytes held by the tier", labels=["tier"])
    st = cache.status()
    for tier in ("device", "host"):
        hits.add_metric([tier], st["hits"][tier])
        misses.add_metric([tier], st["misses"][tier])
        resident.add_metric([tier], st[tier]["used_bytes"])
    return hits, misses, resident


def _hint_gauges(monitor):
    """1 while a hint with this name is active (any model); `fed` 0 when this daemon has no data for the rule."""
    active = GaugeMetricFamily("gpuserv_hint_active", "1 while a troubleshooting hint is active", labels=["name"])
    fed = GaugeMetricFamily("gpuserv_hint_fed", "1 when the daemon feeds every input the hint rule reads",
                            labels=["name"])
    on = {h["name"] for h in monitor.hints()}
    for rule in monitor.rule_status():
        active.add_metric([rule["name"]], 1 if rule["name"] in on else 0)
        fed.add_metric([rule["name"]], 1 if rule["fed"] else 0)
    yield from (active, fed)


def _sharing_metrics(st: dict):
    """The arbiter (time slices, bandwidth priority) and memory quotas, per model; nothing when the arbiter is off."""
    m = ["model_name"]
    arb = st["arbiter"]
    if arb.get("enabled"):
        run = CounterMetricFamily("gpuserv_arbiter_run_seconds", "Time the model held its SM group", labels=m)
        wait = CounterMetricFamily("gpuserv_arbiter_wait_seconds", "Time the model waited for its turn", labels=m)
        slices = CounterMetricFamily("gpuserv_arbiter_slices", "Time slices the model held", labels=m)
        duty = GaugeMetricFamily("gpuserv_arbiter_duty", "Bandwidth-priority duty cycle (1 = not throttled)",
                                 labels=m)
        usage = GaugeMetricFamily("gpuserv_arbiter_usage", "Recent share of time holding the group (~5 s average)",
                                  labels=m)
        for name, x in arb["models"].items():
            run.add_metric([name], x["run_s"])
            wait.add_metric([name], x["wait_s"])
            slices.add_metric([name], x["num_slices"])
            duty.add_metric([name], x["duty"])
            usage.add_metric([name], x["usage"])
        switch = CounterMetricFamily("gpuserv_arbiter_switch_seconds", "Time spent handing groups over")
        switch.add_metric([], arb["switch_s"])
        yield from (run, wait, slices, duty, usage, switch)
    quota = GaugeMetricFamily("gpuserv_memory_quota_bytes", "The model's memory quota", labels=m)
    used = GaugeMetricFamily("gpuserv_memory_quota_used_bytes", "Weights + KV in use + activations + overhead",
                             labels=m)
    for name, q in st["quotas"].items():
        quota.add_metric([name], q["quota"])
        if q.get("used_bytes") is not None:
            used.add_metric([name], q["used_bytes"])
    yield from (quota, used)

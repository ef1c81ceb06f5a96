"""Prometheus metrics (GET /metrics), named as vLLM names them where the meaning is the same.

vLLM's names (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, ...) let
existing dashboards, routers and the inference gateway's endpoint picker read
us unchanged; everything else is `gpuserv_*`. Per-model series carry a
`model_name` label. Gauges are read from the engine loops' snapshots at scrape
time (api/metrics_gauges.py); counters and histograms are updated by the engine
threads (`on_step`, `on_abort`) and the HTTP layer (`rejected`).

Request-level histograms mean what vLLM's mean (times from the request's
arrival at the HTTP layer, on the monotonic clock):
- queue time: arrival -> first scheduled into the batch (includes a wait for
  the model's load);
- prefill time: first scheduled -> first token; decode time: first token ->
  last token; inference time: first scheduled -> last token;
- `vllm:request_time_per_output_token_seconds`: one observation per request,
  its decode time / (output tokens - 1);
- `vllm:time_per_output_token_seconds` and `vllm:inter_token_latency_seconds`:
  one observation per generated token after the first (the gap to the one
  before), the former being vLLM's older name for the latter.

A model's series are created at zero when it loads (dashboards see them before
the first request) and removed when it unloads, so a scrape never carries a
model that is gone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

from gpuservd.api.exposition import Exposition
from gpuservd.api.metrics_gauges import GaugeCollector

prometheus_client.disable_created_metrics()  # no *_created series: vLLM exposes none either

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# vLLM's buckets, so the histograms line up on a shared dashboard.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
# vLLM sizes its token-count buckets 1-2-5 up to the model's context; one set serves every model here.
TOKEN_BUCKETS = tuple(float(m * 10 ** e) for e in range(6) for m in (1, 2, 5))
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
FINISH_REASONS = ("stop", "length", "abort")
SWAP_DIRECTIONS = ("out", "in")


def observe_n(hist, amount: float, n: int) -> None:
    """n observations of the same amount in a histogram child: what n observe() calls give, in one pass
    (prometheus_client has no weighted observe; this adds to the child's bucket and sum as observe does)."""
    buckets, bounds = getattr(hist, "_buckets", None), getattr(hist, "_upper_bounds", None)
    if n == 1 or buckets is None or bounds is None:
        for _ in range(n):
            hist.observe(amount)
        return
    hist._sum.inc(amount * n)
    for i, bound in enumerate(bounds):
        if amount <= bound:
            buckets[i].inc(n)
            break


@dataclass
class _ModelSeries:
    """One model's children of the labelled metrics, looked up once at load instead of every step."""

    preemptions: object
    prompt_tokens: object
    generation_tokens: object
    ttft: object
    tpot: object
    itl: object
    e2e: object
    step: object
    decision: object
    recomputed: object
    request_prompt_tokens: object
    request_generation_tokens: object
    queue: object
    prefill: object
    decode: object
    inference: object
    request_tpot: object
    prefix_queries: object
    prefix_hits: object


class Metrics:
    """The daemon's registry; `serving` is read at scrape time for gauges."""

    def __init__(self):
        self.serving = None  # set by the daemon once Serving exists
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, m, buckets=buckets, registry=r)

        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted", m, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens prefilled", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests", m + ["finished_reason"], registry=r)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token (from HTTP arrival)", TTFT_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Time between consecutive output tokens, one observation per token (vLLM's older name "
                         "for vllm:inter_token_latency_seconds)", TPOT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output tokens", TPOT_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Per request: decode time / (output tokens - 1)", TPOT_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "End-to-end request latency", E2E_BUCKETS)
        self.request_prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt tokens of each finished request",
                                          TOKEN_BUCKETS)
        self.request_generation_tokens = hist("vllm:request_generation_tokens",
                                              "Output tokens of each finished request", TOKEN_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "From arrival to first scheduled (WAITING)", E2E_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "From first scheduled to first token (PREFILL)",
                            E2E_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "From first token to last token (DECODE)", E2E_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "From first scheduled to last token (RUNNING)",
                              E2E_BUCKETS)
        self.step = hist("gpuserv_step_duration_seconds", "Engine step wall time (schedule+forward+sample)",
                         STEP_BUCKETS)
        self.decision = hist("gpuserv_scheduler_decision_seconds", "Scheduler decision time per step", STEP_BUCKETS)
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
        self._series: dict[str, _ModelSeries] = {}  # model -> its children (present while it is loaded)
        # model -> (metric, label values) of the children made on the fly (finish reasons, preemption kinds)
        self._extra: dict[str, set[tuple]] = {}
        # bumped by what a client can observe before it scrapes (a request's end, a refusal, a model coming
        # or going): a body rendered before the bump is not served from the scrape cache (api/scrape_cache.py)
        self.epoch = 0
        self.on_epoch: Callable[[], None] | None = None  # called on the bumping thread after each bump
        gauges = GaugeCollector(self)
        self.registry.register(gauges)
        typed = [v for v in vars(self).values() if isinstance(v, (Counter, Histogram))]  # in the order made
        self.exposition = Exposition(typed, [gauges])

    # ---- a model's series -------------------------------------------------------------------------

    def add_model(self, model: str) -> None:
        """Create the model's series at zero, so dashboards see them before the first request."""
        self._series[model] = _ModelSeries(
            self.preemptions.labels(model), self.prompt_tokens.labels(model), self.generation_tokens.labels(model),
            self.ttft.labels(model), self.tpot.labels(model), self.itl.labels(model), self.e2e.labels(model),
            self.step.labels(model), self.decision.labels(model), self.recomputed_tokens.labels(model),
            self.request_prompt_tokens.labels(model), self.request_generation_tokens.labels(model),
            self.queue.labels(model), self.prefill.labels(model), self.decode.labels(model),
            self.inference.labels(model), self.request_tpot.labels(model), self.prefix_queries.labels(model),
            self.prefix_hits.labels(model))
        self._extra.setdefault(model, set())
        for direction in SWAP_DIRECTIONS:
            self._child(self.swap_bytes, model, direction)
            self._child(self.swap_seconds, model, direction)
        for reason in FINISH_REASONS:
            self._child(self.success, model, reason)
        self._bump()  # after the change, as every bump: a body rendered before it is not served

    def remove_model(self, model: str) -> None:
        """Drop every series of a model that is gone (its engine has stopped: nothing records for it now)."""
        if self._series.pop(model, None) is None:
            return
        for metric in (self.preemptions, self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.itl,
                       self.e2e, self.step, self.decision, self.recomputed_tokens, self.request_prompt_tokens,
                       self.request_generation_tokens, self.queue, self.prefill, self.decode, self.inference,
                       self.request_tpot, self.prefix_queries, self.prefix_hits):
            metric.remove(model)
            self.exposition.forget(metric, (model,))
        for metric, labels in self._extra.pop(model, set()):
            metric.remove(*labels)
            self.exposition.forget(metric, labels)
        for key in [k for k in self._last_token if k[0] == model]:
            self._last_token.pop(key, None)
        self._bump()

    def _child(self, metric, model: str, *rest: str):
        """A child with labels beyond the model's, remembered so that remove_model can drop it."""
        labels = (model, *rest)
        self._extra.setdefault(model, set()).add((metric, labels))
        return metric.labels(*labels)

    # ---- engine threads ---------------------------------------------------------------------------

    def on_step(self, model: str, rec, outputs: list) -> None:
        """Engine thread: one step's record and outputs."""
        s = self._series.get(model)
        if s is None:  # the model is being unloaded: its series are gone
            return
        s.step.observe(rec.wall_s)
        s.decision.observe(rec.decision_s)
        if rec.num_preempted:
            s.preemptions.inc(rec.num_preempted)
            for p in rec.preemptions:
                self._child(self.preemptions_by_kind, model, p["kind"], p["reason"]).inc()
                if p["tokens_to_recompute"]:
                    s.recomputed.inc(p["tokens_to_recompute"])
        if rec.num_prefix_query_tokens:
            s.prefix_queries.inc(rec.num_prefix_query_tokens)
            s.prefix_hits.inc(rec.num_prefix_hit_tokens)
        for mv in rec.swaps:
            direction = mv["kind"].removeprefix("swap_")
            self._child(self.swap_bytes, model, direction).inc(mv["bytes_moved"])
            self._child(self.swap_seconds, model, direction).inc(mv["seconds"])
        now = time.monotonic()
        generated = 0
        lasts: dict[float, int] = {}  # the previous token's time -> streams: mostly one, the previous step's
        for out in outputs:
            key = (model, out.request_id)
            if out.new_token_ids:
                generated += len(out.new_token_ids)
                if out.num_output_tokens == 1:  # prefill done: its prompt was processed
                    s.prompt_tokens.inc(out.num_prompt_tokens)
                else:
                    last = self._last_token.get(key)
                    if last is not None:
                        lasts[last] = lasts.get(last, 0) + 1
                self._last_token[key] = now
            if out.finished:
                self._finished(model, s, out)
                self._last_token.pop(key, None)
        for last, n in lasts.items():  # each gap once with its count, not 2 observations per stream per step
            observe_n(s.itl, now - last, n)
            observe_n(s.tpot, now - last, n)
        if generated:
            s.generation_tokens.inc(generated)

    def on_abort(self, model: str, out) -> None:
        """Engine thread: a request was aborted (client gone, cancel, drain)."""
        self._last_token.pop((model, out.request_id), None)
        s = self._series.get(model)
        if s is not None:
            self._finished(model, s, out)

    def _finished(self, model: str, s: _ModelSeries, out) -> None:
        reason = out.finish_reason.value if out.finish_reason else "unknown"
        self._child(self.success, model, reason).inc()
        s.request_prompt_tokens.observe(out.num_prompt_tokens)
        s.request_generation_tokens.observe(out.num_output_tokens)
        end, first = out.finish_time, out.first_token_time
        scheduled = getattr(out, "scheduled_time", None)
        if end is not None:
            s.e2e.observe(end - out.arrival_time)
        if scheduled is not None:
            s.queue.observe(scheduled - out.arrival_time)
            if first is not None:
                s.prefill.observe(first - scheduled)
            if end is not None:
                s.inference.observe(end - scheduled)
        if first is not None:
            s.ttft.observe(first - out.arrival_time)
            if end is not None:
                s.decode.observe(end - first)
                if out.num_output_tokens > 1:
                    s.request_tpot.observe((end - first) / (out.num_output_tokens - 1))
        self._bump()  # after the observations: a scrape that sees the new epoch renders them

    # ---- HTTP layer -------------------------------------------------------------------------------

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()
        self._bump()

    def http_error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()
        self._bump()

    def _bump(self) -> None:
        self.epoch += 1
        if self.on_epoch is not None:
            self.on_epoch()

    def render(self) -> bytes:
        return self.exposition.render()

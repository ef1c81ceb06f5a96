"""Rules over the weight cache (hit rates, evictions, loads), fed by `weights/` through the daemon:

- `status.weight_cache` (sampled once per evaluation): cumulative `hits` and
  `misses` per tier (`{"device": n, "host": n}`), `device.cache_size`; the
  monitor adds the config's `cache.hit_rate_alert`;
- `model_evict` events (or `model_unload` with `"reason": "evicted"`) and
  `model_load` events with `"phase": "start"` (optionally `num_queued`,
  requests waiting for that load).

The sizing suggestion comes from the request trace itself (`request_finished`
events): an LRU of k models replayed over the recent sequence of requested models.
"""

from __future__ import annotations

from collections import OrderedDict

from gpuservd.hints.rule import Rule, Thresholds, _is_eviction
from gpuservd.hints.window import Window, r3


def lru_hit_rate(models: list[str], size: int) -> float:
    """Hit rate of an LRU cache of `size` models over a sequence of requested models."""
    cache: OrderedDict[str, None] = OrderedDict()
    hits = 0
    for m in models:
        if m in cache:
            hits += 1
            cache.move_to_end(m)
        else:
            cache[m] = None
            if len(cache) > size:
                cache.popitem(last=False)
    return hits / len(models) if models else 0.0


def lru_size_for(models: list[str], target: float) -> tuple[int, float]:
    """The smallest LRU size (in models) reaching `target` over the sequence, and its hit rate
    (the number of distinct models when none does: that is the most a cache can do)."""
    distinct = len(set(models))
    for k in range(1, distinct + 1):
        rate = lru_hit_rate(models, k)
        if rate >= target:
            return k, rate
    return distinct, lru_hit_rate(models, distinct)


def _count(sample: dict, key: str, tier: str) -> int:
    return int((sample.get(key) or {}).get(tier, 0))


def cache_hit_rate_low(w: Window, model: None, th: Thresholds) -> dict | None:
    """A tier's hit rate over the window is under its threshold."""
    since = w.now - th.event_span_s
    samples = [s for s in w.weight_cache if s.get("hits") is not None and s.get("t", 0) >= since]
    if not samples:
        return None
    first, last = samples[0], samples[-1]
    alert = float(last.get("hit_rate_alert") or th.hit_rate_alert)
    worst = None
    for tier in last["hits"]:
        # counters are cumulative: the window's lookups are the difference (all of them with one sample)
        hits = _count(last, "hits", tier) - (_count(first, "hits", tier) if len(samples) >= 2 else 0)
        misses = _count(last, "misses", tier) - (_count(first, "misses", tier) if len(samples) >= 2 else 0)
        if hits + misses < th.hit_rate_min_lookups:
            continue
        rate = hits / (hits + misses)
        if rate < alert and (worst is None or rate < worst[1]):
            worst = (tier, rate, hits, misses)
    if worst is None:
        return None
    trace = [e["model"] for e in w.recent_events("request_finished", th.event_span_s) if e.get("model")]
    size, size_rate = lru_size_for(trace, alert) if trace else (None, None)
    cache_size = (last.get("device") or {}).get("cache_size")
    if size is not None and cache_size is not None and size <= cache_size:
        return None  # the cache already holds every model the traffic asks for: its misses are first loads
    return {"tier": worst[0], "hit_rate": r3(worst[1]), "hits": worst[2], "misses": worst[3], "threshold": alert,
            "cache_size": cache_size, "suggested_cache_size": size,
            "suggested_hit_rate": r3(size_rate) if size_rate is not None else None, "num_requests": len(trace),
            "num_models": len(set(trace))}


def load_after_evict(w: Window, model: None, th: Thresholds) -> dict | None:
    """A burst needed a model the cache had just evicted, so the burst waited on a load."""
    events = w.recent_events(("model_unload", "model_evict", "model_load", "request_finished"), th.event_span_s)
    evicted_at: dict[str, float] = {}
    found = []
    for e in events:
        m = e.get("model")
        if _is_eviction(e):
            evicted_at[m] = e["t"]
        elif e["type"] == "model_load" and e.get("phase") == "start" and m in evicted_at:
            gap = e["t"] - evicted_at[m]
            if gap > th.evict_reload_s:
                continue
            arrivals = sum(1 for r in events if r["type"] == "request_finished" and r.get("model") == m
                           and abs(_arrival(r) - e["t"]) <= th.burst_span_s)
            burst = max(arrivals, int(e.get("num_queued") or 0))
            if burst >= th.burst_min_requests:
                found.append((m, gap, burst))
    if not found:
        return None
    m, gap, burst = found[-1]
    return {"model": m, "evicted_s_before": r3(gap), "num_requests": burst, "num_reloads": len(found),
            "threshold_s": th.evict_reload_s}


def _arrival(e: dict) -> float:
    """When a finished request arrived (wall clock): its arrival_t, else its finish time minus its latency."""
    if e.get("arrival_t") is not None:
        return float(e["arrival_t"])
    return float(e["t"]) - float(e.get("e2e_s") or 0.0)


RULES = [
    Rule("cache_hit_rate_low", "weight-cache tier hit rate under its threshold",
         "the cache is too small for the set of models the traffic asks for",
         "raise cache.cache_size to {suggested_cache_size} models: the last {num_requests} requests would hit "
         "{suggested_hit_rate} with it (the {tier} tier hits {hit_rate} < {threshold}), or enable prefetch",
         ("weight_cache", "request_finished"), cache_hit_rate_low, per_model=False),
    Rule("load_after_evict", "loads started during a burst for a model just evicted",
         "the LRU evicted a model the traffic still needs, so a burst waits on a reload",
         "pin {model} (gpuserv models pin {model}) or enable prefetch; evicted {evicted_s_before} s before "
         "{num_requests} requests needed it",
         ("evictions", "request_finished"), load_after_evict, per_model=False),
]

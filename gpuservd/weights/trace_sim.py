"""Hit rates of the weight cache's own policy on a request trace (LRU, prefetch, hit rates), against Belady.

`replay` drives the real `WeightCache` (LRU eviction, the same `plan_device_load`
the daemon uses) and the real `Predictor` with a trace of model names; loads are
instantaneous here because a hit rate depends only on which model is where.
`belady` is the offline optimum of demand caching for the same trace (evict the
model whose next use is farthest away). `make_trace` builds a multi-model trace:
bases with variants, Zipf popularity (the top 10 of 32 get ~80%), sessions of
consecutive requests to one model, and workflows (a model is often followed by
one of two related ones), which is what a predictor can learn.
"""

from __future__ import annotations

import random

from gpuservd.errors import UserError
from gpuservd.weights.cache import WeightCache
from gpuservd.weights.config import CacheConfig
from gpuservd.weights.prefetch import PrefetchStats, Predictor


def make_trace(num_bases: int = 4, variants_per_base: int = 7, num_requests: int = 6000, zipf_s: float = 1.1,
               mean_session: float = 2.5, follow: float = 0.6, seed: int = 0) -> tuple[list[str], dict]:
    rng = random.Random(seed)
    models = [f"base{b}" if v == 0 else f"base{b}-v{v}" for b in range(num_bases) for v in range(variants_per_base + 1)]
    order = models[:]
    rng.shuffle(order)
    weights = [1.0 / (i + 1) ** zipf_s for i in range(len(order))]
    # Workflows: each model is often followed by one of two others, popular ones more likely.
    successors = {}
    for m in models:
        pool = [x for x in order if x != m]
        picks: list[str] = []
        while len(picks) < 2:
            c = rng.choices(pool, [weights[order.index(x)] for x in pool])[0]
            if c not in picks:
                picks.append(c)
        successors[m] = picks
    trace: list[str] = []
    current = rng.choices(order, weights)[0]
    while len(trace) < num_requests:
        run = 1 + int(rng.expovariate(1 / max(1e-9, mean_session - 1)))
        trace.extend([current] * run)
        current = rng.choice(successors[current]) if rng.random() < follow else rng.choices(order, weights)[0]
    trace = trace[:num_requests]
    counts = {m: trace.count(m) for m in models}
    top10 = sum(sorted(counts.values(), reverse=True)[:10]) / len(trace)
    return trace, {"models": len(models), "bases": num_bases, "requests": len(trace), "top10_share": top10,
                   "zipf_s": zipf_s, "mean_session": mean_session, "follow": follow, "seed": seed}


def replay(trace: list[str], cache_size: int, prefetch: bool, min_prob: float = 0.2) -> dict:
    """Hit rate of LRU (+ prefetch) with `cache_size` models on the device."""
    cache = WeightCache(CacheConfig(cache_size=cache_size), device_budget=1 << 60)
    predictor = Predictor(min_prob=min_prob)
    stats = PrefetchStats()
    for model in trace:
        if cache.touch(model):
            if model in stats.pending:
                stats.pending.discard(model)
                stats.used += 1
        else:
            _place(cache, model, set(), stats)
        predictor.observe(model)
        if prefetch:
            for nxt, p in predictor.next_models(model):
                if nxt in cache.device:
                    continue
                try:
                    evict = cache.plan_device_load(nxt, 1, busy={model})
                except UserError:
                    continue
                if all(predictor.value(e) < p for e in evict):
                    _place(cache, nxt, {model}, stats, evict)
                    stats.issued += 1
                    stats.pending.add(nxt)
    hits, misses = cache.hits["device"], cache.misses["device"]
    return {"cache_size": cache_size, "prefetch": prefetch, "hits": hits, "misses": misses,
            "hit_rate": hits / (hits + misses), "prefetch_stats": stats.to_dict() if prefetch else None}


def _place(cache: WeightCache, model: str, busy: set, stats: PrefetchStats, evict: list[str] | None = None) -> None:
    for e in evict if evict is not None else cache.plan_device_load(model, 1, busy):
        cache.device_evicted(e)
        if e in stats.pending:
            stats.pending.discard(e)
            stats.wasted += 1
    cache.device_loaded(model, 1)


def belady(trace: list[str], cache_size: int) -> dict:
    """Offline optimum: on a miss with a full cache, evict the model used farthest in the future."""
    nxt_use = [0] * len(trace)
    last: dict[str, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        nxt_use[i] = last.get(trace[i], len(trace) + 1)
        last[trace[i]] = i
    resident: dict[str, int] = {}  # model -> index of its next use
    hits = 0
    for i, m in enumerate(trace):
        if m in resident:
            hits += 1
        elif len(resident) >= cache_size:
            del resident[max(resident, key=resident.get)]
        resident[m] = nxt_use[i]
    return {"cache_size": cache_size, "hits": hits, "misses": len(trace) - hits, "hit_rate": hits / len(trace)}

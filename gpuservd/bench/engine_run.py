"""gpuserv's own side of a benchmark: a workload replayed on an in-process engine.

Requests are submitted at their arrival offsets while the engine steps, the
same way the daemon's engine loop admits them; times are what a caller of
step() sees (a token exists when the step that made it returns).
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

from gpuservd.bench.records import RequestTiming, SystemRun
from gpuservd.engine.request import SamplingParams
from gpuservd.kv_cache.prefault import PoolCommitter


def _params(max_tokens: int):
    # Forced lengths, greedy, no text: the same work the peers are asked to do.
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def commit_kv_pool(engine) -> int:
    """Commit the engine's CPU KV pool before a replay, as the daemon's idle engine loop does before
    traffic arrives (kv_cache/prefault.py); returns the bytes committed (0 where GPUSERV_KV_PREFAULT=0 or
    the pool is not on the CPU). A fresh in-process engine would otherwise pay the pool's first-write
    faults inside the burst's steps (~0.5 s of the mixed burst's short phase on the 2-core VM) that
    the daemon it is compared with has already paid while idle."""
    committer = PoolCommitter.for_cache(getattr(getattr(engine, "runner", None), "cache", None))
    if committer is None:
        return 0
    committer.commit_all()
    return committer.num_committed_bytes


def warm_up(engine) -> None:
    """One short request so that first-call costs (allocator, kernels) stay out of the timings."""
    engine.generate([[100 + i for i in range(16)]] * 2, _params(4))


def run_gpuserv(engine, requests: Sequence) -> SystemRun:
    """Replay requests (WorkloadRequest) on the engine; returns per-request timings and step stats."""
    warm_up(engine)
    first_step = engine.telemetry.num_steps
    pending = sorted(requests, key=lambda r: r.arrival_s)
    by_id = {r.request_id: r for r in pending}
    first: dict[str, float] = {}
    timings: list[RequestTiming] = []
    t0 = time.perf_counter()
    i = 0

    def urgent(priority: int) -> bool:
        """Layer granularity: has a request above `priority` arrived since the step began?"""
        return i < len(pending) and pending[i].arrival_s <= time.perf_counter() - t0 and pending[i].priority > priority

    engine.interrupt = urgent
    while i < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(pending) and pending[i].arrival_s <= now:
            r = pending[i]
            engine.add_request(
                r.request_id, r.prompt_token_ids, _params(r.output_tokens), priority=r.priority, tenant=r.tenant
            )
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[i].arrival_s - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        done_at = time.perf_counter() - t0
        for o in outs:
            first.setdefault(o.request_id, done_at)
            if o.finished:
                r = by_id[o.request_id]
                timings.append(
                    RequestTiming(r.request_id, r.cls, r.arrival_s, first[o.request_id], done_at,
                                  len(r.prompt_token_ids), o.num_output_tokens)
                )
    wall = time.perf_counter() - t0
    engine.interrupt = None
    steps = engine.telemetry.recent()[-(engine.telemetry.num_steps - first_step):]
    extra = {
        "num_steps": len(steps),
        "step_ms_p50": 1000 * statistics.median(s.wall_s for s in steps) if steps else None,
        "max_decode_batch": max((s.num_decode_tokens for s in steps), default=0),
        "busy_share": sum(s.wall_s for s in steps) / wall if wall > 0 else None,  # time spent in steps
        "outputs_exact": all(t.output_tokens == by_id[t.request_id].output_tokens for t in timings),
        **preemption_costs(steps),
        **prefix_cache_use(engine, steps),
    }
    return SystemRun("gpuserv", wall, sorted(timings, key=lambda t: t.request_id), extra)


def prefix_cache_use(engine, steps) -> dict:
    """The prefix cache over a run, from the step records: tokens looked up, found, and their ratio."""
    queried = sum(s.num_prefix_query_tokens for s in steps)
    hit = sum(s.num_prefix_hit_tokens for s in steps)
    return {"prefix_caching": engine.config.prefix_caching, "prefix_query_tokens": queried,
            "prefix_hit_tokens": hit, "prefix_hit_rate": hit / queried if queried else None}


def preemption_costs(steps) -> dict:
    """What scheduling and preemption cost over a run, from the step records (the cost must stay
    below what they win)."""
    wall = max(1e-9, sum(s.wall_s for s in steps))
    per_request: dict[str, int] = {}
    kinds: dict[str, int] = {}
    reasons: dict[str, int] = {}
    for s in steps:
        for rid in s.preempted_ids:
            per_request[rid] = per_request.get(rid, 0) + 1
        for p in s.preemptions:
            kinds[p["move"]] = kinds.get(p["move"], 0) + 1
            reasons[p["reason"]] = reasons.get(p["reason"], 0) + 1
    swaps = [m for s in steps for m in s.swaps]
    events = [e.type for s in steps for e in s.events]
    return {
        "scheduler_s": sum(s.decision_s for s in steps),
        "scheduler_share": sum(s.decision_s for s in steps) / wall,  # of step time
        "num_preempted": sum(s.num_preempted for s in steps),
        "max_preemptions_per_request": max(per_request.values(), default=0),
        "preemptions_by_kind": kinds,
        "preemptions_by_reason": reasons,
        "swap_bytes": sum(m["bytes_moved"] for m in swaps),
        "park_bytes": sum(m["bytes_parked"] for m in swaps),
        "swap_s": sum(s.swap_s for s in steps),
        "swap_share": sum(s.swap_s for s in steps) / wall,
        "tokens_recomputed": sum(p["tokens_to_recompute"] for s in steps for p in s.preemptions),
        "layer_suspends": events.count("layer_suspend"),
        "mode_switches": events.count("preemption_mode"),
    }


def batch1_decode_step_s(engine, prompt_tokens: int = 32, new_tokens: int = 64) -> float:
    """Median wall time of a decode step with one sequence in the batch."""
    engine.generate([[100 + i for i in range(prompt_tokens)]], _params(new_tokens))
    steps = engine.telemetry.recent(new_tokens - 1)
    decode = [s.wall_s for s in steps if s.num_decode_tokens == 1 and s.num_prefill_tokens == 0]
    return statistics.median(decode)

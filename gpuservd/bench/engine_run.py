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


def _params(max_tokens: int):
    from gpuservd.engine.request import SamplingParams

    # Forced lengths, greedy, no text: the same work the peers are asked to do.
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)


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
    steps = engine.telemetry.recent()[-(engine.telemetry.num_steps - first_step):]
    extra = {
        "num_steps": len(steps),
        "step_ms_p50": 1000 * statistics.median(s.wall_s for s in steps) if steps else None,
        "scheduler_share": sum(s.decision_s for s in steps) / max(1e-9, sum(s.wall_s for s in steps)),
        "num_preempted": sum(s.num_preempted for s in steps),
        "max_decode_batch": max((s.num_decode_tokens for s in steps), default=0),
        "outputs_exact": all(t.output_tokens == by_id[t.request_id].output_tokens for t in timings),
    }
    return SystemRun("gpuserv", wall, sorted(timings, key=lambda t: t.request_id), extra)


def batch1_decode_step_s(engine, prompt_tokens: int = 32, new_tokens: int = 64) -> float:
    """Median wall time of a decode step with one sequence in the batch."""
    engine.generate([[100 + i for i in range(prompt_tokens)]], _params(new_tokens))
    steps = engine.telemetry.recent(new_tokens - 1)
    decode = [s.wall_s for s in steps if s.num_decode_tokens == 1 and s.num_prefill_tokens == 0]
    return statistics.median(decode)

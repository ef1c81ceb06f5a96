"""Who gives up its KV blocks when a running request needs one and none is free (chosen so long requests are not starved).

Policies, named in `VictimPolicy`:
- `newest`: the most recently admitted request (vLLM's rule; cheap, not fair).
- `most_remaining`: the request with the most tokens left (the naive rule the
  seed saw starve long requests; kept for comparison).
- `progress`: the request with the least progress, executed time / estimated
  total time, so a request close to done is never thrown back.
- `weighted`: a score over remaining tokens, priority and resources already
  spent (tokens whose KV would be lost), weights in config.
- `srf`: the request the waiting queue's order would rank last: the largest
  claim (remaining work less aging, engine/policy.py). Under `scheduler.order:
  srf` any other victim is the wrong one: it ranks ahead of some running request
  and comes straight back, and the preemption bought nothing. A request that
  has waited long has a small claim, so aging protects it here too. Under
  `order: fcfs` every claim is 0 and the newest is chosen.

Every policy honours two guards: a request that has run for less than
`min_exec_s` since it was (re)admitted is not chosen (a minimum execution time
guarantee), and a request already preempted `max_preemptions` times is not
chosen again (aging). If the guards leave no candidate while nothing else can
make progress, the scheduler falls back to the least-preempted request so the
engine never deadlocks.
"""

from __future__ import annotations

from typing import Callable

from gpuservd.config import PreemptionConfig, VictimPolicy
from gpuservd.engine.request import Request


def remaining_tokens(r: Request) -> int:
    return max(0, r.params.max_tokens - len(r.output_token_ids))


def progress(r: Request) -> float:
    """Executed share of the request's estimated total work, in tokens (prompt + max_tokens)."""
    total = r.num_prompt_tokens + r.params.max_tokens
    return (r.num_prompt_tokens + len(r.output_token_ids)) / total if total else 1.0


def _norm(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    return [0.0 if hi == lo else (v - lo) / (hi - lo) for v in values]


def choose_victim(candidates: list[Request], cfg: PreemptionConfig, now: float,
                  claim: Callable[[Request], float] | None = None) -> Request | None:
    """The request to preempt among candidates (admission order), or None if the guards exclude all.
    claim: the scheduler's order key (policy `srf`; None ranks by tokens left to generate)."""
    eligible = [
        r for r in candidates
        if r.num_preemptions < cfg.max_preemptions and now - r.admitted_time >= cfg.min_exec_s
    ]
    if not eligible:
        return None
    policy = VictimPolicy.parse(cfg.victim_policy)
    if policy is VictimPolicy.NEWEST:
        return eligible[-1]
    if policy is VictimPolicy.MOST_REMAINING:
        return max(reversed(eligible), key=remaining_tokens)
    if policy is VictimPolicy.PROGRESS:
        return min(reversed(eligible), key=progress)
    if policy is VictimPolicy.SRF:
        return max(reversed(eligible), key=claim or remaining_tokens)  # ties: the newest
    w = cfg.weights
    rem = _norm([float(remaining_tokens(r)) for r in eligible])
    pri = _norm([float(r.priority) for r in eligible])
    spent = _norm([float(r.num_computed_tokens) for r in eligible])
    scores = [w.remaining * a - w.priority * b - w.spent * c for a, b, c in zip(rem, pri, spent)]
    best = max(range(len(eligible)), key=lambda i: (scores[i], i))  # ties: the newest
    return eligible[best]


def fallback_victim(candidates: list[Request]) -> Request | None:
    """When the guards exclude everyone and nothing can run: the least-preempted, newest request."""
    if not candidates:
        return None
    return min(reversed(candidates), key=lambda r: r.num_preemptions)

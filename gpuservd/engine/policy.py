"""Scheduling policies: the waiting-queue order, named in Enums with factories.

The order of requests, most important first:
1. priority: a class a tenant or client asked for (higher first). Remaining work never crosses it:
   a priority is a statement of importance, and letting a short low-priority request pass a long
   high-priority one would make priorities mean "unless you are short".
2. `scheduler.order`: `srf` ranks equal-priority requests by remaining work (shortest first, with
   aging, `WorkOrder`); `fcfs` leaves them equal here.
3. tenants' shares, then `scheduler.policy`'s tie-break (arrival time, or priority then arrival).

Under srf one request may pass the order: the critical lane's (`critical_request`), the largest one
waiting when nothing as large runs, so that a burst's longest request does not start last.

The scheduler only asks for keys, so a policy never touches KV or batches.
"""

from __future__ import annotations

from typing import Callable

from gpuservd.config import Order, Policy
from gpuservd.engine.request import Request


def queue_key(policy: Policy) -> Callable[[Request], tuple]:
    """The sort key of the waiting queue under a policy (smaller runs first)."""
    if policy is Policy.FCFS:
        return lambda r: (r.arrival_time,)
    if policy is Policy.PRIORITY:
        return lambda r: (-r.priority, r.arrival_time)
    raise ValueError(f"no queue order for policy {policy}")


def remaining_work(r: Request) -> int:
    """Tokens the request still costs: prompt tokens still to prefill + tokens still to generate
    (max_tokens bounds the length: the only length a server knows up front)."""
    return max(0, r.num_prompt_tokens - r.num_computed_tokens) + r.remaining_estimate


def total_work(r: Request) -> int:
    """Tokens the request costs from start to end (prompt + max_tokens): its size, whatever it has done."""
    return r.num_prompt_tokens + r.params.max_tokens


class WorkOrder:
    """Shortest remaining work first, with aging so that long requests are never starved.

    A request's claim is its remaining work minus `aging` tokens for every engine step since it arrived,
    never below 0. The age counts in engine steps, not seconds: a running request works off one token
    a step, so the rate means the same on a CPU and on a GPU whose steps are 20x shorter, and the same
    workload is ordered the same way on both. The age counts from arrival and is kept through
    preemptions, so a request sent back to the queue does not start waiting again from nothing.

    Once a request's claim reaches 0 it ties with every other aged request, and ties go by arrival:
    a request waits at most (its work / aging) steps before only earlier arrivals can pass it, which
    is what bounds the wait of the longest request. Under `fcfs` every claim is 0 (arrival order)."""

    def __init__(self, order: Order, aging: float):
        self.srf = order is Order.SRF
        self.aging = aging

    def claim(self, r: Request, step: int) -> float:
        """The request's rank at engine step `step` (smaller goes first)."""
        if not self.srf:
            return 0.0
        return max(0.0, remaining_work(r) - self.aging * (step - r.arrival_step))


# The critical lane in batches of at least this many sequences: it takes one slot from the shorter
# requests, at most an eighth of the batch; in a narrower one it would take a large share of it.
LANE_MIN_SEQS = 8


def critical_request(waiting: list[Request], running: list[Request], skip: set[str]) -> Request | None:
    """The request the critical lane admits ahead of the queue's order (scheduler.critical_lane): among the
    waiting requests of the queue's first priority, the largest (prompt + max_tokens), when it is larger
    than every running request. A burst ends when its longest request does, one token a step: left to the
    end of the queue, it would run its whole length on the narrow steps after the shorter ones are done.
    Sizes, not remaining work: a running request's remaining work shrinks a token a step, and by it every
    waiting request of that size would come through the lane in turn."""
    if not waiting:
        return None
    top = waiting[0].priority
    cand = max((r for r in waiting if r.priority == top and r.request_id not in skip), key=total_work, default=None)
    if cand is None or total_work(cand) <= max((total_work(r) for r in running), default=0):
        return None
    return cand

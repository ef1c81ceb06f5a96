"""Scheduling policies: an Enum with a factory for the waiting-queue order.

The preemption issue adds victim policies next to these; the scheduler only
asks a policy for an ordering key, so a policy never touches KV or batches.
"""

from __future__ import annotations

from typing import Callable

from gpuservd.config import Policy
from gpuservd.engine.request import Request


def queue_key(policy: Policy) -> Callable[[Request], tuple]:
    """The sort key of the waiting queue under a policy (smaller runs first)."""
    if policy is Policy.FCFS:
        return lambda r: (r.arrival_time,)
    if policy is Policy.PRIORITY:
        return lambda r: (-r.priority, r.arrival_time)
    raise ValueError(f"no queue order for policy {policy}")

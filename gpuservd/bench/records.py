"""What one benchmark run of one system produced.

Every system (gpuserv's engine and each transformers peer) reports the same
dataclasses, so the report computes every number the same way for all of them.
Times are seconds since the run started (the instant request offsets count
from), taken from one monotonic clock (`time.perf_counter`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestTiming:
    """When one request arrived, saw its first token and finished."""

    request_id: str  # the workload's id for the request (same across systems)
    cls: str  # request class name from the workload ("short", "long", ...)
    arrival_s: float  # when it was submitted, seconds since run start
    first_token_s: float  # when its first generated token existed, seconds since run start
    finish_s: float  # when the user got the whole response, seconds since run start
    prompt_tokens: int  # prompt length in tokens
    output_tokens: int  # tokens actually generated for it

    @property
    def latency_s(self) -> float:
        """End-to-end latency as the user sees it."""
        return self.finish_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        """Time to first token."""
        return self.first_token_s - self.arrival_s


@dataclass
class SystemRun:
    """One system's run of a whole workload."""

    system: str  # "gpuserv", "hf_static" or "hf_continuous"
    wall_s: float  # run start to the last response, seconds
    requests: list[RequestTiming]  # one per workload request
    extra: dict = field(default_factory=dict)  # free-form: per-step stats, token-count checks, caveats

    @property
    def generated_tokens(self) -> int:
        """Output tokens over all requests."""
        return sum(r.output_tokens for r in self.requests)

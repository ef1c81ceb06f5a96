"""Per-step telemetry: one record per engine step in a bounded ring buffer (step granularity: per-second
aggregates hide the steps that hurt).

The console, /metrics, `gpuserv doctor` and the benchmarks all read these same
records; per-second aggregates hide the steps that hurt.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass, field


@dataclass
class StepRecord:
    """What one engine step did and cost."""

    step_id: int  # per engine, from 1
    model: str
    t: float  # wall-clock time (time.time()) at the end of the step
    wall_s: float  # whole step: schedule + forward + sample + update
    forward_s: float  # model forward
    sample_s: float  # sampling + detokenization + stop checks
    decision_s: float  # scheduler decision time (its own cost, kept below what it wins)
    num_prefill_tokens: int  # tokens in prefill chunks
    num_decode_tokens: int  # one-token (decode) chunks
    num_running: int  # after the step's decision
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preempted: int  # requests preempted this step
    num_finished: int  # requests that finished this step
    preempted_ids: list[str] = field(default_factory=list)  # which requests were preempted this step
    swap_s: float = 0.0  # KV copies (swap out / in, parking) before the forward
    preemptions: list[dict] = field(default_factory=list)  # per victim: kind, reason, blocks, bytes, seconds
    swaps: list[dict] = field(default_factory=list)  # per copy: swap_out / swap_in, bytes, seconds
    events: list[dict] = field(default_factory=list)  # e.g. auto mode switches, with their evidence
    preemption_on: bool = False  # displacement and the planner active at this step
    kv_host_blocks_used: int = 0  # the host swap pool
    kv_host_blocks_total: int = 0
    kv_blocks_reserved: int = 0  # free blocks promised to requests that may not be preempted again
    num_prefix_query_tokens: int = 0  # prefix cache: known tokens of the requests admitted fresh this step
    num_prefix_hit_tokens: int = 0  # of them, reused from cached blocks (not computed)
    num_prefix_repeat_tokens: int = 0  # caching off: of them, tokens a prefix cache would have reused
    prefix_caching: bool = False  # engine.prefix_caching at this step

    def to_dict(self) -> dict:
        return asdict(self)


class Telemetry:
    """A thread-safe ring of StepRecords plus listeners (the daemon's event stream)."""

    def __init__(self, size: int = 4096):
        self._ring: deque[StepRecord] = deque(maxlen=size)
        self._lock = threading.Lock()
        self._listeners: list = []
        self.num_steps = 0

    def record(self, rec: StepRecord) -> None:
        with self._lock:
            self._ring.append(rec)
            self.num_steps += 1
            listeners = list(self._listeners)
        for fn in listeners:
            fn(rec)

    def recent(self, n: int | None = None) -> list[StepRecord]:
        with self._lock:
            items = list(self._ring)
        return items if n is None else items[-n:]

    def subscribe(self, fn) -> None:
        with self._lock:
            self._listeners.append(fn)

    def unsubscribe(self, fn) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

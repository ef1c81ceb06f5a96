"""What one scheduling decision hands the engine: the batch, the preemptions and the KV moves.

Only these dataclasses leave the scheduler; the engine executes them and the
per-step telemetry records them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuservd.engine.request import Request
from gpuservd.kv_cache.swap import KVMove


@dataclass
class ScheduledChunk:
    """Work for one request in one step."""

    request: Request
    start_pos: int  # first position computed this step (== request.num_computed_tokens)
    num_tokens: int  # tokens computed this step
    sample: bool  # this chunk reaches the last known token, so a new token is sampled


@dataclass
class Preemption:
    """One victim: how its KV left the device and what that will cost (priced so preemption is chosen only where it pays)."""

    request_id: str
    kind: str  # swap | partial_swap | recompute
    reason: str  # memory | threshold | displaced
    blocks_freed: int  # device blocks given back now
    tokens_to_recompute: int  # recompute: tokens whose KV was dropped
    move: KVMove | None = None  # swap / partial swap: the copy (bytes and seconds filled when executed)

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "request_id": self.request_id, "reason": self.reason,
             "blocks_freed": self.blocks_freed, "tokens_to_recompute": self.tokens_to_recompute}
        if self.move is not None:
            d.update(bytes_moved=self.move.bytes_moved, bytes_parked=self.move.bytes_parked,
                     seconds=self.move.seconds)
        return d


@dataclass
class SchedulerOutput:
    """Everything one scheduling decision produced (also the telemetry's input)."""

    step_id: int
    chunks: list[ScheduledChunk] = field(default_factory=list)  # the batch, decode first
    num_prefill_tokens: int = 0  # tokens in multi-token chunks
    num_decode_tokens: int = 0  # one-token chunks
    preempted_ids: list[str] = field(default_factory=list)  # preempted this step
    preemptions: list[Preemption] = field(default_factory=list)
    moves: list[KVMove] = field(default_factory=list)  # swap-outs and swap-ins, to run in this order
    num_running: int = 0  # after this decision
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_reserved: int = 0  # free, but promised to pinned requests' growth (not admissible)
    kv_blocks_total: int = 0
    num_prefix_query_tokens: int = 0  # prefix cache: known tokens of the requests admitted fresh this step
    num_prefix_hit_tokens: int = 0  # of them, found cached and not computed (vLLM's hits)
    num_prefix_repeat_tokens: int = 0  # caching off: of them, tokens a prefix cache would have found
    decision_s: float = 0.0  # wall time of schedule() itself

    @property
    def empty(self) -> bool:
        return not self.chunks

    def count_prefix_lookup(self, queried: int, hit: int, repeated: int) -> None:
        self.num_prefix_query_tokens += queried
        self.num_prefix_hit_tokens += hit
        self.num_prefix_repeat_tokens += repeated


@dataclass(frozen=True)
class KVLayout:
    """What the planner needs to know about a block."""

    num_layers: int
    bytes_per_block: int

"""Continuous batching: the batch is re-formed every step.

Each step the scheduler first gives every running sequence its next tokens
(one decode token, or the next prefill chunk), then admits waiting requests
while the token budget, the prefill budget, `max_num_seqs` and the KV pool
allow. A running sequence that needs a block when none is free takes it from
the most recently admitted running sequence, which is preempted by recompute
(its blocks are freed; its prompt and generated tokens are prefilled again on
resume). Which running request is preempted is the victim policy's choice
(engine/victim.py). The scheduler does no I/O and no model math; it returns what it
decided as a `SchedulerOutput`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gpuservd.config import PreemptionConfig, SchedulerConfig
from gpuservd.engine.policy import Policy, queue_key
from gpuservd.engine.request import Request, RequestState
from gpuservd.engine.victim import choose_victim, fallback_victim
from gpuservd.kv_cache.block_pool import BlockPool


@dataclass
class ScheduledChunk:
    """Work for one request in one step."""

    request: Request
    start_pos: int  # first position computed this step (== request.num_computed_tokens)
    num_tokens: int  # tokens computed this step
    sample: bool  # this chunk reaches the last known token, so a new token is sampled


@dataclass
class SchedulerOutput:
    """Everything one scheduling decision produced (also the telemetry's input)."""

    step_id: int
    chunks: list[ScheduledChunk] = field(default_factory=list)  # the batch, decode first
    num_prefill_tokens: int = 0  # tokens in multi-token chunks
    num_decode_tokens: int = 0  # one-token chunks
    preempted_ids: list[str] = field(default_factory=list)  # preempted by recompute this step
    num_running: int = 0  # after this decision
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    decision_s: float = 0.0  # wall time of schedule() itself

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """Owns the waiting and running queues and the block tables of a model's requests."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, block_size: int,
                 preemption: PreemptionConfig | None = None):
        self.config = config
        self.preemption = preemption or PreemptionConfig()
        self.pool = pool
        self.block_size = block_size
        self.policy = Policy.parse(config.policy)
        self._key = queue_key(self.policy)
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self._step_id = 0

    # -- queue management -------------------------------------------------
    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (finish or abort)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._free_blocks(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _free_blocks(self, request: Request) -> None:
        if request.block_ids:
            self.pool.free(request.block_ids)
            request.block_ids = []

    def _blocks_needed(self, request: Request, num_new: int) -> int:
        total = -(-(request.num_computed_tokens + num_new) // self.block_size)
        return max(0, total - len(request.block_ids))

    def _grow(self, request: Request, num_new: int) -> bool:
        need = self._blocks_needed(request, num_new)
        if need == 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        request.block_ids.extend(got)
        return True

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Recompute preemption: drop the victim's KV; it is prefilled again when resumed."""
        self.running.remove(victim)
        self._free_blocks(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.state = RequestState.PREEMPTED
        self.waiting.append(victim)
        out.preempted_ids.append(victim.request_id)

    # -- the decision -----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        t0_mono = time.monotonic()
        self._step_id += 1
        cfg = self.config
        out = SchedulerOutput(step_id=self._step_id)
        token_budget = cfg.max_num_batched_tokens
        prefill_budget = cfg.max_prefill_tokens
        prefill_seqs = 0
        scheduled: set[int] = set()

        for req in list(self.running):
            if token_budget <= 0:
                break
            if req not in self.running:
                continue  # preempted as a victim earlier in this loop
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining > 1:  # still prefilling (prompt or recompute)
                if prefill_seqs >= cfg.max_num_prefill_seqs or prefill_budget <= 0:
                    continue
                num_new = min(remaining, prefill_budget, token_budget)
            else:
                num_new = 1
            while not self._grow(req, num_new):
                # A running request that got nothing this step gives its blocks back.
                candidates = [r for r in self.running if id(r) not in scheduled]
                victim = choose_victim(candidates, self.preemption, t0_mono)
                if victim is None:
                    break
                self._preempt(victim, out)
                if victim is req:
                    break
            if req not in self.running or self._blocks_needed(req, num_new):
                continue
            self._add_chunk(out, req, num_new)
            scheduled.add(id(req))
            token_budget -= num_new
            if remaining > 1:
                prefill_budget -= num_new
                prefill_seqs += 1

        if not out.chunks and self.running and not out.preempted_ids:
            # Every running request needs a block, none is free and the guards protect them
            # all: without this the engine would wait forever.
            self._preempt(fallback_victim(self.running), out)
        if not out.preempted_ids:
            self._admit(out, token_budget, prefill_budget, prefill_seqs)
        out.num_running = len(self.running)
        out.num_waiting = len(self.waiting)
        out.kv_blocks_used = self.pool.num_used
        out.kv_blocks_total = self.pool.num_blocks
        out.chunks.sort(key=lambda c: c.num_tokens != 1)
        out.decision_s = time.perf_counter() - t0
        return out

    def _admit(self, out: SchedulerOutput, token_budget: int, prefill_budget: int, prefill_seqs: int) -> None:
        cfg = self.config
        self.waiting.sort(key=self._key)
        while (
            self.waiting
            and token_budget > 0
            and prefill_budget > 0
            and prefill_seqs < cfg.max_num_prefill_seqs
            and len(self.running) < cfg.max_num_seqs
        ):
            req = self.waiting[0]
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = min(remaining, prefill_budget, token_budget)
            if not self._grow(req, num_new):
                break  # the pool is full: new requests wait
            self.waiting.pop(0)
            req.state = RequestState.RUNNING
            req.admitted_time = time.monotonic()
            self.running.append(req)
            self._add_chunk(out, req, num_new)
            token_budget -= num_new
            prefill_budget -= num_new
            prefill_seqs += 1

    def _add_chunk(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        sample = start + num_new == req.num_tokens
        out.chunks.append(ScheduledChunk(req, start, num_new, sample))
        if num_new == 1:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += num_new

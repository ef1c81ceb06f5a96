"""Continuous batching with preemption: the batch is re-formed every step.

A step's decision, in order:
1. (preemption on) keep device KV use at or below `memory_threshold`: while it
   is above, a victim's KV leaves the device (to host memory, whole or in part).
2. (preemption on, granularity token or layer) displacement: a waiting request
   that cannot be admitted and outranks running requests (higher priority, or
   equal priority and, under `order: srf`, an aged remaining-work claim
   `outrank_ratio` times smaller) takes the place of victims chosen among those
   it outranks.
3. Every running sequence gets its next tokens (one decode token, or the next
   prefill chunk); one that needs a block when none is free takes it from a
   victim (the victim policy); with preemption off the victim is recomputed.
4. Waiting requests are admitted (priority first, then the least remaining work
   with aging under `order: srf` or arrival under fcfs, the critical lane's
   request first: engine/policy.py) while the token budget, the prefill budget,
   `max_num_seqs`, their tenant's quota and the KV pool allow. A swapped request
   comes back with a swap-in; a dropped one re-allocates its dropped blocks and
   rebuilds them with a prefix prefill.

How a victim's KV leaves is the planner's choice (engine/preemption.py): swap,
partial swap (last layers parked on the device) or recompute (oldest blocks
dropped). Who is the victim is the victim policy's (engine/victim.py). The
scheduler does no copies and no model math: it returns the KV moves it decided,
in order, with the batch, as a `SchedulerOutput`. Block tables are the KV
cache manager's (kv_cache/manager.py): the scheduler asks it for blocks and
moves and never edits a block list itself.
"""

from __future__ import annotations

import time

from gpuservd.config import Order, PreemptionConfig, SchedulerConfig
from gpuservd.engine.policy import LANE_MIN_SEQS, Policy, WorkOrder, critical_request, queue_key, total_work
from gpuservd.engine.preemption import (AutoMode, CostModel, Granularity, MoveKind, PreemptionMode,
                                        plan_kind)
from gpuservd.engine.quota import UNLIMITED, TenantQuota
from gpuservd.engine.request import Rebuild, Request, RequestState
from gpuservd.engine.schedule_output import KVLayout, Preemption, ScheduledChunk, SchedulerOutput
from gpuservd.engine.victim import choose_victim, fallback_victim
from gpuservd.kv_cache.block_pool import BlockPool
from gpuservd.kv_cache.manager import KVCacheManager


class Scheduler:
    """Owns the waiting and running queues of a model's requests; `kv` owns their blocks."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool, block_size: int,
                 preemption: PreemptionConfig | None = None, host_pool=None, layout: KVLayout | None = None,
                 prefix_caching: bool = False, namespace: str = ""):
        self.config = config
        self.preemption = preemption or PreemptionConfig()
        p = self.preemption
        self.mode = PreemptionMode.parse(p.mode)
        self.granularity = Granularity.parse(p.granularity)
        self.kind = MoveKind.parse(p.kind)
        self.pool = pool
        self.host = host_pool  # HostKVPool or None (no swap space: recompute only)
        self.layout = layout or KVLayout(1, 0)
        self.kv = KVCacheManager(pool, block_size, host_pool, self.layout.num_layers, prefix_caching, namespace)
        self.keep_layers = int(round(p.partial_keep_fraction * self.layout.num_layers))
        self.block_size = block_size
        self.policy = Policy.parse(config.policy)
        self._key = queue_key(self.policy)
        self.order = WorkOrder(Order.parse(config.order), config.aging)
        self.cost = CostModel()
        self.auto = AutoMode(p.auto_window, p.auto_ratio, p.auto_min_samples)
        self.quotas: dict[str, TenantQuota] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admission order
        self._step_id = 0
        self._lane: set[str] = set()  # running requests the critical lane admitted (_critical)

    @property
    def preemption_on(self) -> bool:
        """Whether running requests may be displaced and KV moved by the planner right now."""
        return self.mode is PreemptionMode.ON or (self.mode is PreemptionMode.AUTO and self.auto.enabled)

    # -- queue management -------------------------------------------------
    def add(self, request: Request) -> None:
        request.state = RequestState.WAITING
        request.arrival_step = self._step_id
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free everything it holds (finish or abort)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        self.kv.forget(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _release(self, r: Request) -> None:
        """Free a request's device blocks, parked blocks and host blocks; it keeps no KV."""
        self.kv.free(r)
        r.rebuild = None
        r.num_computed_tokens = 0

    # -- aging: requests that may not be preempted again run to their end ---
    def is_pinned(self, r: Request) -> bool:
        """Preempted max_preemptions times: never chosen again, so its KV must always fit."""
        return r.num_preemptions >= self.preemption.max_preemptions

    def _total_blocks(self, r: Request) -> int:
        """Device blocks r holds at its longest (every token but the last sampled one has KV)."""
        return -(-(r.num_prompt_tokens + r.params.max_tokens - 1) // self.block_size)

    def reserved_blocks(self, tenant: str | None = None) -> int:
        """Blocks the running pinned requests will still allocate. Admission leaves them free, so a
        pinned request never needs a victim it may not have (it would have to break the aging bound,
        or the engine would stall): issue 3 promises no request is preempted more than
        max_preemptions times."""
        return sum(max(0, self._total_blocks(r) - self.kv.num_table_blocks(r)) for r in self.running
                   if self.is_pinned(r) and tenant in (None, r.tenant))

    def quota(self, tenant: str) -> TenantQuota:
        return self.quotas.get(tenant, UNLIMITED)

    # -- preemption -------------------------------------------------------
    def _preempt(self, victim: Request, out: SchedulerOutput, need: int, reason: str) -> None:
        """Take a running victim out of the batch; its KV leaves as the planner (or `off`) decides."""
        self.running.remove(victim)
        kind = self._plan(victim, need)
        move = None
        if kind in (MoveKind.SWAP, MoveKind.PARTIAL_SWAP):
            if kind is MoveKind.PARTIAL_SWAP:
                move, freed = self.kv.park(victim, self.keep_layers)
                kind = MoveKind.PARTIAL_SWAP if move.park_blocks else MoveKind.SWAP  # too few unshared blocks
            else:
                move, freed = self.kv.swap_out(victim)
            out.moves.append(move)
            victim.state = RequestState.SWAPPED
            tokens = 0
        else:
            freed, tokens = self._recompute(victim, need)
            victim.state = RequestState.PREEMPTED
        victim.num_preemptions += 1
        victim.num_recomputed_tokens += tokens
        self.waiting.append(victim)
        out.preempted_ids.append(victim.request_id)
        out.preemptions.append(Preemption(victim.request_id, kind.value, reason, freed, tokens, move))

    def _plan(self, victim: Request, need: int) -> MoveKind:
        """How the victim's KV leaves: the planner's price (preemption on), else recompute."""
        n = self.kv.num_table_blocks(victim)
        if not self.preemption_on or n == 0:
            return MoveKind.RECOMPUTE
        lay = self.layout
        return plan_kind(self.kind, self.cost, host_free=self.kv.num_host_free, n_blocks=n, need=need,
                         bytes_per_block=lay.bytes_per_block, keep_layers=self.keep_layers,
                         num_layers=lay.num_layers, block_size=self.block_size,
                         n_parked=self.kv.park_blocks_for(n, self.keep_layers))

    def _recompute(self, victim: Request, need: int) -> tuple[int, int]:
        """Recompute: drop the oldest `need` blocks and keep the tail when that frees enough (and the
        victim is not already rebuilding a dropped prefix), else drop everything. The request rebuilds
        what was dropped with a prefix prefill when it resumes. Returns (blocks freed, tokens lost)."""
        n = self.kv.num_table_blocks(victim)
        d = min(need, n)
        computed = victim.num_computed_tokens
        if self.preemption_on and 0 < d < n and computed > d * self.block_size and victim.rebuild is None:
            freed = self.kv.drop_oldest(victim, d)
            victim.rebuild = Rebuild(until=d * self.block_size, resume_at=computed)
            victim.num_computed_tokens = 0
            return freed, d * self.block_size
        self._release(victim)
        return n, computed

    def _drop_paused(self, r: Request) -> None:
        """A waiting request's kept tail or parked layers go too: it will be recomputed in full."""
        r.num_recomputed_tokens += r.num_kv_tokens
        self._release(r)
        r.state = RequestState.PREEMPTED

    def claim(self, r: Request) -> float:
        """r's rank by remaining work under `scheduler.order` now (smaller first; 0 for all under fcfs)."""
        return self.order.claim(r, self._step_id)

    def _outranks(self, w: Request, r: Request) -> bool:
        if w.priority != r.priority:
            return w.priority > r.priority
        if not self.order.srf:
            return False  # arrival order: equal priorities never pass each other, not even by displacement
        # Aged claims on both sides: a running request that has been in the engine long enough for its
        # claim to run out is not displaced by a newcomer, whatever its length (its wait is bounded).
        return max(1.0, self.claim(r)) >= self.preemption.outrank_ratio * max(1.0, self.claim(w))

    def _usable_blocks(self) -> int:
        """Blocks admission may fill: the threshold's share of the pool while preemption is on."""
        if not self.preemption_on:
            return self.pool.capacity
        return max(1, int(self.preemption.memory_threshold * self.pool.capacity))

    def _tenant_usage(self) -> tuple[dict[str, int], dict[str, int]]:
        seqs: dict[str, int] = {}
        blocks: dict[str, int] = {}
        for r in self.running:
            seqs[r.tenant] = seqs.get(r.tenant, 0) + 1
        for r in self.running + self.waiting:
            n = self.kv.num_device_blocks(r)
            if n:
                blocks[r.tenant] = blocks.get(r.tenant, 0) + n
        return seqs, blocks

    def _tenant_allows(self, r: Request, extra_blocks: int, seqs: dict, blocks: dict) -> bool:
        q = self.quota(r.tenant)
        if q.max_running_seqs and seqs.get(r.tenant, 0) >= q.max_running_seqs:
            return False
        if not q.max_kv_blocks:
            return True
        if self.is_pinned(r):  # the same run-to-the-end rule as admission, within the tenant's blocks
            extra_blocks = max(extra_blocks, self._total_blocks(r) - self.kv.num_device_blocks(r))
        return blocks.get(r.tenant, 0) + extra_blocks + self.reserved_blocks(r.tenant) <= q.max_kv_blocks

    def _order_waiting(self, seqs: dict[str, int]) -> None:
        """Priority first; then (order srf, in every preemption mode) the least aged remaining work;
        tenants by running sequences per unit of weight; then the policy's own order (engine/policy.py)."""

        def key(r: Request):
            share = seqs.get(r.tenant, 0) / self.quota(r.tenant).weight
            return (-r.priority, self.claim(r), share) + self._key(r)

        self.waiting.sort(key=key)

    # -- the decision -----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        t0 = time.perf_counter()
        now = time.monotonic()
        self._step_id += 1
        out = SchedulerOutput(step_id=self._step_id)
        self.kv.begin_step(self.running)
        seqs, blocks = self._tenant_usage()
        self._order_waiting(seqs)
        self._enforce_quota(out, now)
        if self.preemption_on:
            self._enforce_threshold(out, now)
            if self.granularity is not Granularity.REQUEST:
                self._displace(out, now, seqs, blocks)
        budgets = self._schedule_running(out, now)
        if not out.chunks and self.running and not out.preempted_ids:
            # Every running request needs a block, none is free and the guards protect them
            # all: without this the engine would wait forever.
            self._preempt(fallback_victim(self.running), out, need=1, reason="memory")
        self._admit(out, *budgets)
        out.num_running = len(self.running)
        out.num_waiting = len(self.waiting)
        out.kv_blocks_used = self.pool.num_used
        out.kv_blocks_reserved = self.reserved_blocks()
        out.kv_blocks_total = self.pool.num_blocks
        out.chunks.sort(key=lambda c: c.num_tokens != 1)
        out.decision_s = time.perf_counter() - t0
        return out

    def _enforce_quota(self, out: SchedulerOutput, now: float) -> None:
        """Over the model's memory quota (the pool's capacity was lowered), its own requests leave
        the device (swap, partial swap or recompute as the planner prices them) until it fits again.
        Whatever the preemption mode: a quota is a limit, not a preference."""
        while self.pool.num_used > self.pool.capacity:
            held = [r for r in self.waiting if self.kv.num_device_blocks(r) and r.request_id not in out.preempted_ids]
            if held:  # paused requests' kept blocks go first, as for any shortage
                self._reclaim_from_waiting(None, self.pool.num_used - self.pool.capacity, set(out.preempted_ids))
                if self.pool.num_used <= self.pool.capacity:
                    return
            if not self.running:
                return
            victim = choose_victim(self.running, self.preemption, now, self.claim) or fallback_victim(self.running)
            self._preempt(victim, out, need=self.pool.num_used - self.pool.capacity, reason="quota")

    def _enforce_threshold(self, out: SchedulerOutput, now: float) -> None:
        usable = self._usable_blocks()
        while self.pool.num_used > usable and len(self.running) > 1:
            victim = choose_victim(self.running, self.preemption, now, self.claim)
            if victim is None:
                return
            self._preempt(victim, out, need=self.pool.num_used - usable, reason="threshold")

    def _displace(self, out: SchedulerOutput, now: float, seqs: dict, blocks: dict) -> None:
        """Waiting requests that outrank running ones take their places (at most
        max_num_prefill_seqs victims a step)."""
        cfg = self.config
        slots = cfg.max_num_seqs - len(self.running)
        reserved = self.reserved_blocks()  # pinned requests' growth, then what earlier waiters will take
        victims_left = cfg.max_num_prefill_seqs
        for w in list(self.waiting):
            if w.request_id in out.preempted_ids:
                continue
            need = self.kv.blocks_needed(w, min(w.gap_end - w.num_computed_tokens, cfg.max_prefill_tokens))
            if not self._tenant_allows(w, need, seqs, blocks):
                continue
            while slots < 1 or need > self._usable_blocks() - self.pool.num_used - reserved:
                outranked = [r for r in self.running if self._outranks(w, r)]
                victim = choose_victim(outranked, self.preemption, now, self.claim) if victims_left > 0 else None
                if victim is None:
                    return  # w waits; requests ranked below it do not displace either
                self._preempt(victim, out, need=max(1, need - (self._usable_blocks() - self.pool.num_used)),
                              reason="displaced")
                victims_left -= 1
                slots += 1
            slots -= 1
            reserved += need

    def _schedule_running(self, out: SchedulerOutput, now: float) -> tuple[int, int, int]:
        cfg = self.config
        token_budget = cfg.max_num_batched_tokens
        prefill_budget = cfg.max_prefill_tokens
        prefill_seqs = 0
        scheduled: set[int] = set()
        # Pinned requests first: a block they need comes from the free pool or from a request that
        # may still be preempted, never from one already scheduled this step. Under srf the decodes
        # (one token each) come next and the prefill budget goes by least remaining work; under fcfs
        # everyone keeps admission order.
        for req in sorted(self.running, key=self._running_key):
            if token_budget <= 0:
                break
            if req not in self.running:
                continue  # preempted as a victim earlier in this loop
            remaining = req.gap_end - req.num_computed_tokens
            if remaining > 1:  # still prefilling (prompt, recompute or a dropped prefix)
                if prefill_seqs >= cfg.max_num_prefill_seqs or prefill_budget <= 0:
                    continue
                num_new = min(remaining, prefill_budget, token_budget)
            else:
                num_new = 1
            if not self._within_tenant_blocks(req, num_new, out, now, scheduled):
                continue
            while self.kv.allocate_slots(req, num_new) is None:
                short = self.kv.blocks_needed(req, num_new) - self.pool.num_free
                if self._reclaim_from_waiting(None, short, set(out.preempted_ids)):
                    continue  # blocks kept by paused requests come before a running victim's
                candidates = [r for r in self.running if id(r) not in scheduled]
                victim = choose_victim(candidates, self.preemption, now, self.claim)
                if victim is None:
                    break
                self._preempt(victim, out, need=self.kv.blocks_needed(req, num_new), reason="memory")
                if victim is req:
                    break
            if req not in self.running or self.kv.blocks_needed(req, num_new):
                continue
            self._add_chunk(out, req, num_new)
            scheduled.add(id(req))
            token_budget -= num_new
            if remaining > 1:
                prefill_budget -= num_new
                prefill_seqs += 1
        return token_budget, prefill_budget, prefill_seqs

    def _running_key(self, r: Request) -> tuple:
        if not self.order.srf:
            return (not self.is_pinned(r),)
        return not self.is_pinned(r), r.gap_end - r.num_computed_tokens > 1, self.claim(r)

    def _within_tenant_blocks(self, req: Request, num_new: int, out: SchedulerOutput, now: float,
                              scheduled: set[int]) -> bool:
        """A tenant at its KV block quota grows only by taking blocks from its own requests:
        its waiting ones' kept blocks first, then a running victim of the same tenant."""
        cap = self.quota(req.tenant).max_kv_blocks
        if not cap:
            return True
        while True:
            held = sum(self.kv.num_device_blocks(r) for r in self.running + self.waiting if r.tenant == req.tenant)
            over = held + self.kv.blocks_needed(req, num_new) - cap
            if over <= 0:
                return True
            holder = next((r for r in reversed(self.waiting) if r.tenant == req.tenant
                           and self.kv.num_device_blocks(r) and r.request_id not in out.preempted_ids), None)
            if holder is not None:
                self._drop_paused(holder)
                continue
            own = [r for r in self.running if r.tenant == req.tenant and id(r) not in scheduled]
            if not own:
                return False  # its blocks are parked by this step's victims: it waits a step
            victim = choose_victim(own, self.preemption, now, self.claim) or fallback_victim(own)
            self._preempt(victim, out, need=over, reason="tenant_quota")
            if victim is req:
                return False

    def _admit(self, out: SchedulerOutput, token_budget: int, prefill_budget: int, prefill_seqs: int) -> None:
        cfg = self.config
        seqs, blocks = self._tenant_usage()
        usable = self._usable_blocks()
        just_preempted = set(out.preempted_ids)
        reserved = self.reserved_blocks()
        # The lane's request is left out of the deferral's measure: beside it, the requests the deferral
        # holds back until the short ones are done would no longer look large.
        self._lane.intersection_update(r.request_id for r in self.running)
        largest = max((total_work(r) for r in self.running if r.request_id not in self._lane), default=0)
        lane = self._critical(just_preempted)
        for req in ([lane] if lane else []) + [r for r in self.waiting if r is not lane]:
            if (token_budget <= 0 or prefill_budget <= 0 or prefill_seqs >= cfg.max_num_prefill_seqs
                    or len(self.running) >= cfg.max_num_seqs):
                return
            if req.request_id in just_preempted or (req is not lane and self._deferred(req, largest)):
                continue
            queried = self.kv.num_lookup_tokens(req)
            prefix = self.kv.find_cached_prefix(req)
            if prefix is not None and prefix.deferred:
                continue  # another request computes its next block this step: it shares that next step
            hit = prefix.num_tokens if prefix is not None else 0
            num_new = min(req.gap_end - req.num_computed_tokens - hit, prefill_budget, token_budget)
            need = self.kv.blocks_needed(req, num_new, prefix)
            charge = self.kv.blocks_to_hold(req, num_new, prefix)
            if not self._tenant_allows(req, charge, seqs, blocks):
                continue  # over its tenant's quota: waits without blocking others
            room = (usable if self.running else self.pool.capacity) - self.pool.num_used - reserved
            # A pinned request comes back only when all it will ever need fits beside the others' reserves.
            pinned = self.is_pinned(req)
            fit = max(need, self._total_blocks(req) - self.kv.num_device_blocks(req)) if pinned else need
            if fit > room and req is lane:
                continue  # the lane takes only what is free; the queue's order decides the rest
            if fit > room and not self._reclaim_from_waiting(req, fit - room, just_preempted):
                return  # the pool is full: this request and those after it wait
            if not self._resume(out, req, num_new, prefix):
                return
            if queried:
                out.count_prefix_lookup(*self.kv.prefix.count_admission(req, prefix, queried))
            self.waiting.remove(req)
            if pinned:
                reserved += max(0, self._total_blocks(req) - self.kv.num_table_blocks(req))
            req.state = RequestState.RUNNING
            req.admitted_time = time.monotonic()
            if req.scheduled_time is None:
                req.scheduled_time = req.admitted_time
            self.running.append(req)
            if req is lane:
                self._lane.add(req.request_id)
            else:
                largest = max(largest, total_work(req))
            seqs[req.tenant] = seqs.get(req.tenant, 0) + 1
            blocks[req.tenant] = blocks.get(req.tenant, 0) + charge
            self._add_chunk(out, req, num_new)
            token_budget -= num_new
            if num_new > 1:
                prefill_budget -= num_new
                prefill_seqs += 1

    def _critical(self, skip: set[str]) -> Request | None:
        """The critical lane's request this step (policy.critical_request), or None. Not while preemption
        is on: displacement would hand the lane's slot straight back to shorter work."""
        if (not self.order.srf or not self.config.critical_lane or self.preemption_on
                or self.config.max_num_seqs < LANE_MIN_SEQS):
            return None
        return critical_request(self.waiting, self.running, skip)

    def _deferred(self, req: Request, largest: int) -> bool:
        """Whether admission passes `req` over this step: while at least `defer_min_running` sequences
        run (a compute-bound step, where a long request's row slows every shorter co-runner), a request
        whose aged claim is `defer_ratio` times the size (prompt + max_tokens) of the largest running one
        or more. Sizes, not remaining work, on the running side: a running request's remaining work
        shrinks as it runs and would defer requests of its own size. Under fcfs every claim is 0."""
        cfg = self.config
        if not self.order.srf or not cfg.defer_ratio or len(self.running) < cfg.defer_min_running or not largest:
            return False
        return self.claim(req) >= cfg.defer_ratio * largest

    def _resume(self, out: SchedulerOutput, req: Request, num_new: int, prefix=None) -> bool:
        """Give an admitted request the device blocks it needs (swap-in, dropped prefix, first chunk
        after a cached prefix, whose tokens then count as computed)."""
        if not self.kv.is_swapped(req):
            if self.kv.allocate_slots(req, num_new, prefix) is None:
                return False
            if prefix is not None:
                req.num_computed_tokens = prefix.num_tokens
            return True
        move = self.kv.swap_in(req, num_new)
        if move is None:
            return False
        out.moves.append(move)
        return True

    def _reclaim_from_waiting(self, head: Request | None, need: int, keep: set[str]) -> bool:
        """Free device blocks held by waiting requests ranked after `head` (all of them when head is
        None: a running request must grow), kept tails and parked layers, lowest-ranked first, by
        dropping their KV for a full recompute. True if `need` blocks were freed. Without this, paused
        requests holding blocks could leave nothing for the one that must run (two requests would
        take turns dropping their own blocks forever: the property test found that)."""
        below = self.waiting[self.waiting.index(head) + 1:] if head is not None else list(self.waiting)
        for r in reversed(below):
            if need <= 0:
                break
            held = self.kv.num_device_blocks(r)
            if not held or r.request_id in keep:
                continue
            need -= held
            self._drop_paused(r)
        return need <= 0

    def _add_chunk(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        self.kv.note_scheduled(req, start, num_new)
        sample = start + num_new == req.num_tokens
        out.chunks.append(ScheduledChunk(req, start, num_new, sample))
        if num_new == 1:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += num_new

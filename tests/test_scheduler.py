"""The continuous-batching scheduler, driven with hand-built model outputs (no model)."""

from __future__ import annotations

import random

import pytest

from factories import arrive_and_cancel
from gpuservd.config import PreemptionConfig, SchedulerConfig
from gpuservd.engine.request import Request, SamplingParams
from gpuservd.engine.scheduler import KVLayout, Scheduler
from gpuservd.errors import UserError
from gpuservd.kv_cache.block_pool import BlockPool


def make_scheduler(num_blocks=64, block_size=4, preemption: PreemptionConfig | None = None, host_blocks=0,
                   num_layers=4, **cfg) -> Scheduler:
    host = BlockPool(host_blocks) if host_blocks else None  # the scheduler only books host blocks
    return Scheduler(SchedulerConfig(**cfg), BlockPool(num_blocks), block_size, preemption, host_pool=host,
                     layout=KVLayout(num_layers, num_layers * 1024))


def make_requests(lengths, max_tokens=4, t0=0.0) -> list[Request]:
    return [
        Request(f"r{i}", list(range(10, 10 + n)), SamplingParams(max_tokens=max_tokens), arrival_time=t0 + i)
        for i, n in enumerate(lengths)
    ]


def run_step(s: Scheduler, finished: list):
    """Apply a fake model: every sampling chunk yields token 7; finish at max_tokens."""
    out = s.schedule()
    for c in out.chunks:
        # What the runner will demand: a block for every position the chunk attends to.
        assert len(s.kv.table(c.request)) * s.block_size >= c.start_pos + c.num_tokens, c.request.request_id
        assert c.start_pos == c.request.num_computed_tokens
    for c in out.chunks:
        c.request.advance(c.num_tokens)
    for c in out.chunks:
        if c.sample:
            r = c.request
            r.output_token_ids.append(7)
            if len(r.output_token_ids) >= r.params.max_tokens:
                s.remove(r)
                finished.append(r)
    return out


def test_batch_reforms_each_step_requests_join_and_leave():
    s = make_scheduler(max_num_batched_tokens=64, max_prefill_tokens=64)
    reqs = make_requests([5, 5], max_tokens=3)
    for r in reqs:
        s.add(r)
    done = []
    out = run_step(s, done)
    assert out.num_prefill_tokens == 10 and out.num_decode_tokens == 0
    late = make_requests([6], max_tokens=2, t0=5)[0]
    late.request_id = "late"
    s.add(late)
    out = run_step(s, done)  # two decodes and the newcomer's prefill in one step
    assert out.num_decode_tokens == 2 and out.num_prefill_tokens == 6
    assert [c.num_tokens for c in out.chunks] == [1, 1, 6]  # decode first
    while s.has_unfinished():
        run_step(s, done)
    assert sorted(r.request_id for r in done) == ["late", "r0", "r1"]
    assert s.pool.num_free == s.pool.num_blocks


def test_chunked_prefill_respects_prefill_and_token_budgets():
    s = make_scheduler(max_num_batched_tokens=16, max_prefill_tokens=8, max_num_seqs=4)
    for r in make_requests([20, 20]):
        s.add(r)
    out = s.schedule()
    assert out.num_prefill_tokens == 8 and len(out.chunks) == 1  # the prefill budget caps the step
    assert not out.chunks[0].sample


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, max_prefill_tokens=64)
    for r in make_requests([3, 3, 3]):
        s.add(r)
    out = s.schedule()
    assert out.num_running == 2 and out.num_waiting == 1


def test_new_requests_wait_when_kv_pool_is_full():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_prefill_tokens=64, order="fcfs")
    for r in make_requests([12, 8]):  # 3 blocks + 2 blocks > 4
        s.add(r)
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["r0"] and out.num_waiting == 1


def test_recompute_preemption_when_running_out_of_blocks():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_prefill_tokens=64,
                       preemption=PreemptionConfig(victim_policy="newest", min_exec_s=0))
    reqs = make_requests([4, 4, 4], max_tokens=8)
    for r in reqs:
        s.add(r)
    done = []
    run_step(s, done)  # 3 blocks used, all full
    out = run_step(s, done)  # each needs a 2nd block: only one is free -> the newest is preempted
    assert out.preempted_ids == ["r2"]
    assert reqs[2].num_computed_tokens == 0 and reqs[2].num_preemptions == 1
    while s.has_unfinished():
        run_step(s, done)
    assert len(done) == 3 and all(len(r.output_token_ids) == 8 for r in done)
    assert s.pool.num_free == 4


def test_priority_policy_orders_waiting_queue():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    low, high = make_requests([3, 3])
    high.priority = 5
    s.add(low)
    s.add(high)
    assert s.schedule().chunks[0].request is high


def test_unknown_policy_names_the_choices():
    with pytest.raises(UserError, match="fcfs, priority"):
        make_scheduler(policy="lottery")


def _full_pool_with(outputs: list[int], max_tokens: list[int], policy: str, **pre):
    """Three running requests filling a 6-block pool (2 blocks each), with given progress, admitted in
    arrival order (order fcfs: "newest" is then r2)."""
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_prefill_tokens=64, order="fcfs",
                       preemption=PreemptionConfig(victim_policy=policy, **pre))
    reqs = []
    for i, (n_out, mt) in enumerate(zip(outputs, max_tokens)):
        r = Request(f"r{i}", [5] * (8 - n_out), SamplingParams(max_tokens=mt), arrival_time=i)
        s.add(r)
        reqs.append(r)
    s.schedule()  # admits all three
    for r, n_out in zip(reqs, outputs):
        r.output_token_ids = [7] * (n_out + 1)  # 9 tokens known, 8 cached: the next step writes position 8
        s.kv.free(r)
        r.num_computed_tokens = 8
    for r in reqs:
        assert len(s.kv.allocate_slots(r, 0)) == 2  # positions 0-7; the pool is now full
        r.admitted_time = 0.0  # long ago: past min_exec_s
    return s, reqs


@pytest.mark.parametrize(
    "policy,victim",
    [
        ("newest", "r2"),
        ("most_remaining", "r0"),  # r0 has 100 tokens left
        ("progress", "r0"),  # r0 is 8 / 108 done, the others ~0.6-0.9
        ("weighted", "r0"),
    ],
)
def test_victim_policies(policy, victim):
    s, reqs = _full_pool_with([1, 5, 2], [100, 6, 10], policy)
    out = s.schedule()
    assert out.preempted_ids == [victim]


def test_weighted_policy_protects_high_priority():
    s, reqs = _full_pool_with([1, 5, 2], [100, 6, 10], "weighted")
    reqs[0].priority = 10
    s.preemption.weights.priority = 5.0
    assert s.schedule().preempted_ids != ["r0"]


def test_aging_and_min_exec_guards():
    s, reqs = _full_pool_with([1, 5, 2], [100, 6, 10], "most_remaining", max_preemptions=2)
    reqs[0].num_preemptions = 2  # aged: never chosen again
    assert s.schedule().preempted_ids == ["r2"]  # next most remaining
    s2, reqs2 = _full_pool_with([1, 5, 2], [100, 6, 10], "most_remaining", min_exec_s=10.0)
    import time as _t

    reqs2[0].admitted_time = _t.monotonic()  # just resumed: protected
    assert s2.schedule().preempted_ids == ["r2"]


def test_guards_never_deadlock():
    """Everyone is protected and every running request needs a block: one is still preempted."""
    s, reqs = _full_pool_with([1, 5, 2], [100, 6, 10], "progress", max_preemptions=1)
    for r in reqs:
        r.num_preemptions = 1
    out = s.schedule()
    assert len(out.preempted_ids) == 1


@pytest.mark.parametrize("mode,kind", [("off", "recompute"), ("on", "swap"), ("on", "partial_swap"),
                                       ("on", "recompute"), ("on", "auto")])
@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_never_leaks_blocks(seed, mode, kind):
    """Random arrivals, lengths, priorities and cancellations on small pools: no block leaks (device
    or host), every request finishes, and the forced kind of move is the one that happens."""
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=rng.randint(8, 20), block_size=4, max_num_seqs=rng.randint(2, 6),
                       max_num_batched_tokens=rng.randint(8, 40), max_prefill_tokens=rng.randint(1, 16),
                       host_blocks=64, policy="priority",
                       preemption=PreemptionConfig(mode=mode, kind=kind, min_exec_s=0, partial_keep_fraction=0.5,
                                                   outrank_ratio=2.0))
    reqs = [
        Request(f"r{i}", [5] * rng.randint(1, 12), SamplingParams(max_tokens=rng.randint(1, 24)),
                priority=rng.choice([0, 0, 1]), arrival_time=i)
        for i in range(30)
    ]
    done, steps, kinds = [], 0, set()
    pending = list(reqs)
    while pending or s.has_unfinished():
        if pending and rng.random() < 0.5:
            s.add(pending.pop(0))
        if rng.random() < 0.05 and s.running:
            victim = rng.choice(s.running)  # a client goes away mid-request
            s.remove(victim)
            done.append(victim)
        out = run_step(s, done)
        kinds |= {p.kind for p in out.preemptions}
        steps += 1
        assert steps < 5000, "scheduler made no progress"
        assert s.pool.num_used == _held(s)
        assert s.host.num_used == sum(s.kv.num_host_blocks(r) for r in s.waiting)
    assert len(done) == 30 and s.pool.num_free == s.pool.num_blocks and s.host.num_free == s.host.num_blocks
    assert kinds, "the workload never preempted: the test exercises nothing"
    if kind != "auto":
        assert kinds == {kind}
    else:
        assert kinds == {"swap"}  # no measured prefill rate: a copy is assumed cheaper


def _held(s: Scheduler) -> int:
    return sum(s.kv.num_device_blocks(r) for r in s.running + s.waiting)


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=150, deadline=None)
@given(
    num_blocks=st.integers(6, 24),
    max_num_seqs=st.integers(1, 8),
    token_budget=st.integers(8, 48),
    prefill_budget=st.integers(1, 24),
    policy=st.sampled_from(["newest", "most_remaining", "progress", "weighted"]),
    mode=st.sampled_from(["off", "on"]),
    granularity=st.sampled_from(["request", "token", "layer"]),
    kind=st.sampled_from(["auto", "swap", "partial_swap", "recompute"]),
    host_blocks=st.integers(0, 30),
    threshold=st.floats(0.5, 1.0),
    tenant_caps=st.tuples(st.integers(0, 3), st.integers(0, 12)),  # tenant "b": max running seqs, max blocks
    reqs=st.lists(
        st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(0, 3), st.integers(0, 3), st.booleans()),
        min_size=1, max_size=20,
    ),  # (prompt tokens, max_tokens, priority, arrival step, tenant b)
    cancel=st.sets(st.integers(0, 19), max_size=3),
)
def test_property_no_leak_no_deadlock_everyone_finishes(num_blocks, max_num_seqs, token_budget, prefill_budget,
                                                        policy, mode, granularity, kind, host_blocks, threshold,
                                                        tenant_caps, reqs, cancel):
    from gpuservd.engine.quota import TenantQuota

    s = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max(token_budget, max_num_seqs), max_prefill_tokens=prefill_budget,
                       policy="priority", host_blocks=host_blocks,
                       preemption=PreemptionConfig(victim_policy=policy, min_exec_s=0, max_preemptions=2, mode=mode,
                                                   granularity=granularity, kind=kind, memory_threshold=threshold,
                                                   partial_keep_fraction=0.5, outrank_ratio=2.0))
    seqs_cap, blocks_cap = tenant_caps
    if blocks_cap:
        blocks_cap = max(blocks_cap, 6)  # any request here needs at most 6 blocks (24 tokens)
    s.quotas = {"b": TenantQuota(weight=2.0, max_running_seqs=seqs_cap, max_kv_blocks=blocks_cap)}
    requests = [Request(f"r{i}", [5] * p, SamplingParams(max_tokens=m), priority=pr, arrival_time=i,
                        tenant="b" if b else "a")
                for i, (p, m, pr, _, b) in enumerate(reqs)]
    arrivals = {i: a for i, (_, _, _, a, _) in enumerate(reqs)}
    done, step = [], 0
    while len(done) < len(requests):
        arrive_and_cancel(s, requests, arrivals, cancel, step, done)
        out = run_step(s, done)
        step += 1
        assert step < 3000, "no progress: deadlock"
        assert s.pool.num_used == _held(s)
        if s.host is not None:
            assert s.host.num_used == sum(s.kv.num_host_blocks(r) for r in s.waiting)
        b_running = [r for r in s.running if r.tenant == "b"]
        assert not seqs_cap or len(b_running) <= seqs_cap
        assert not blocks_cap or sum(s.kv.num_device_blocks(r) for r in s.running + s.waiting if r.tenant == "b") <= blocks_cap
        if mode == "off":
            assert all(p.kind == "recompute" for p in out.preemptions)
        assert max((r.num_preemptions for r in requests), default=0) <= 2, "preempted past max_preemptions"
    assert s.pool.num_free == s.pool.num_blocks and not s.has_unfinished()
    assert s.host is None or s.host.num_free == s.host.num_blocks
    finished = [r for r in done if len(r.output_token_ids) >= r.params.max_tokens]
    assert len(finished) + len([i for i in cancel if i < len(requests)]) >= len(requests)


def test_paused_requests_blocks_do_not_starve_the_running_one():
    """Found by the property test: two requests kept taking turns dropping their own oldest block,
    because the running one preempted itself instead of taking the blocks a paused one kept."""
    s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=2, max_num_batched_tokens=8, max_prefill_tokens=1,
                       policy="priority", preemption=PreemptionConfig(
                           victim_policy="newest", min_exec_s=0, max_preemptions=2, mode="on",
                           granularity="request", memory_threshold=1.0, outrank_ratio=2.0))
    spec = [(1, 1, 0, 0)] * 4 + [(2, 12, 0, 0), (4, 10, 1, 1), (6, 12, 0, 0)]
    reqs = [Request(f"r{i}", [5] * p, SamplingParams(max_tokens=m), priority=pr, arrival_time=i)
            for i, (p, m, pr, _) in enumerate(spec)]
    done, step = [], 0
    while len(done) < len(reqs):
        for r, (_, _, _, at) in zip(reqs, spec):
            if at == step:
                s.add(r)
        run_step(s, done)
        step += 1
        assert step < 500, "two paused requests took turns forever"
    assert s.pool.num_free == s.pool.num_blocks


def test_pinned_request_keeps_its_growth_free_of_admissions():
    """A running request preempted max_preemptions times will still grow to prompt + max_tokens: those
    blocks are reserved, so a newcomer that would take them waits, and the pinned request never needs a
    victim (it could not have one without breaking the aging bound)."""
    s = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=4, preemption=PreemptionConfig(max_preemptions=1))
    pinned = Request("p", [5] * 4, SamplingParams(max_tokens=20), arrival_time=0)  # 23 tokens of KV: 6 blocks
    s.add(pinned)
    done = []
    run_step(s, done)
    pinned.num_preemptions = 1
    assert s.is_pinned(pinned) and s.reserved_blocks() == 6 - len(s.kv.table(pinned))
    s.add(Request("n", [5] * 20, SamplingParams(max_tokens=4), arrival_time=1))  # needs 5 blocks now; 4 are not reserved
    out = run_step(s, done)
    assert [c.request.request_id for c in out.chunks] == ["p"] and out.kv_blocks_reserved == 4
    while pinned not in done:
        out = run_step(s, done)
        assert not out.preempted_ids
    s.add(Request("m", [5] * 16, SamplingParams(max_tokens=4), arrival_time=2))
    while s.has_unfinished():
        run_step(s, done)  # the newcomers run once the pinned request is done
    assert {r.request_id for r in done} == {"p", "n", "m"} and s.pool.num_free == 10


@given(st.lists(st.integers(1, 600), min_size=1, max_size=250))
@settings(max_examples=200, deadline=None)
def test_km_quantile_without_running_requests_is_the_nearest_rank_percentile(lengths):
    from gpuservd.engine.preemption import km_quantile, percentile

    for q in (0.5, 0.99):
        assert km_quantile(lengths, [], q) == (percentile(sorted(lengths), 100 * q), True)


def test_km_quantile_counts_running_requests_as_lower_bounds():
    from gpuservd.engine.preemption import km_quantile

    # Ten finished at 10, ten still running past 100: half the requests are longer than 10, so the
    # median is 10 (known), and the 99th percentile is past anything finished: only a lower bound.
    assert km_quantile([10] * 10, [120] * 10, 0.5) == (10.0, True)
    assert km_quantile([10] * 10, [120] * 10, 0.99) == (120.0, False)
    # Most still running: no median yet.
    assert km_quantile([10] * 3, [20] * 10, 0.5) == (20.0, False)


def test_auto_mode_switches_on_from_long_requests_still_running():
    """Shorts finish first; the long ones still generating already show the tail."""
    from gpuservd.engine.preemption import AutoMode

    auto = AutoMode(window=200, ratio=5.0, min_samples=20)
    for _ in range(19):
        assert auto.observe(20, running=[150, 160]) is None  # under min_samples
    ev = auto.observe(20, running=[150, 160, 5])
    assert auto.enabled and ev["enabled"] and ev["p50"] == 20 and ev["p99"] == 160 and ev["p99_lower_bound"]
    assert ev["running"] == 3
    # Finished lengths alone (the old rule) would have waited: 20 finished at 20 give P99/P50 = 1.
    old = AutoMode(window=200, ratio=5.0, min_samples=20)
    assert all(old.observe(20) is None for _ in range(20)) and not old.enabled


def test_auto_mode_does_not_decide_while_most_requests_are_running():
    """A wide uniform workload warming up: the first finishes are the shortest, and most requests are
    still running, so the median is unknown and nothing switches (no false on)."""
    from gpuservd.engine.preemption import AutoMode

    auto = AutoMode(window=200, ratio=5.0, min_samples=20)
    finished = list(range(10, 30))  # the 20 shortest of lengths 10..500
    running = [40 + 2 * i for i in range(60)]
    for n in finished:
        auto.observe(n, running=running)
    assert not auto.enabled

"""Short requests first: shortest remaining work first with aging, on a tiny model through the real engine
and scheduler. The clock of every ordering decision is the engine's step count, so the tests count steps:
nothing here depends on how fast a loaded machine runs."""

from __future__ import annotations

import pytest
import torch

from gpuservd.config import EngineConfig, PreemptionConfig, SchedulerConfig, config_from_dict, load_config
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import Request, SamplingParams
from gpuservd.engine.scheduler import KVLayout, Scheduler
from gpuservd.errors import UserError
from gpuservd.kv_cache.block_pool import BlockPool

MODES = ["off", "on", "auto"]


def engine(model_dir, order="srf", num_blocks=None, aging=1.0, max_num_seqs=2, **pre) -> LLMEngine:
    cfg = EngineConfig(model="tiny", dtype="float32", block_size=4, kv_cache_bytes=4 << 20,
                       preemption=PreemptionConfig(min_exec_s=0, **pre))
    cfg.scheduler.order, cfg.scheduler.aging, cfg.scheduler.max_num_seqs = order, aging, max_num_seqs
    cfg.validate()
    if num_blocks:
        probe = LLMEngine("tiny", model_dir, cfg)
        cfg.kv_cache_bytes = num_blocks * probe.runner.cache.shape.bytes_per_block
    return LLMEngine("tiny", model_dir, cfg)


def prompt(seed: int, n: int = 8) -> list[int]:
    return torch.randint(3, 290, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def run(eng, arrivals=None, max_steps=2000):
    """Step to the end; arrivals(step) may add requests before a step. Returns ({id: step of its first
    token}, {id: step it finished}, {id: tokens}, {id: times preempted})."""
    first, done, tokens, preempted = {}, {}, {}, {}
    step = 0
    while step < max_steps and (eng.has_unfinished() or arrivals):
        if arrivals:
            arrivals(step)
        if not eng.has_unfinished():
            break
        for o in eng.step():
            first.setdefault(o.request_id, step)
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = step
        for rid in eng.telemetry.recent(1)[-1].preempted_ids:
            preempted[rid] = preempted.get(rid, 0) + 1
        step += 1
    return first, done, tokens, preempted


def add_burst(eng):
    """Two long requests arrive first, then four short ones; all wait together (2 may run)."""
    for i in range(2):
        eng.add_request(f"long{i}", prompt(i), params(24))
    for i in range(4):
        eng.add_request(f"short{i}", prompt(10 + i), params(3))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each request's tokens run alone: whatever the order, the batch must give exactly these."""
    eng = engine(tiny_model_dir, order="fcfs", mode="off", max_num_seqs=1)
    add_burst(eng)
    return run(eng)[2]


@pytest.mark.parametrize("mode", MODES)
def test_short_requests_are_admitted_ahead_of_long_ones_when_both_wait(tiny_model_dir, reference, mode):
    eng = engine(tiny_model_dir, mode=mode)
    add_burst(eng)
    first, done, tokens, _ = run(eng)
    shorts, longs = [f"short{i}" for i in range(4)], ["long0", "long1"]
    # The longs arrived first, yet every short finished before either long got its first token.
    assert max(done[s] for s in shorts) < min(first[lg] for lg in longs)
    assert tokens == reference


@pytest.mark.parametrize("mode", MODES)
def test_fcfs_keeps_arrival_order(tiny_model_dir, reference, mode):
    eng = engine(tiny_model_dir, order="fcfs", mode=mode)
    add_burst(eng)
    first, done, tokens, preempted = run(eng)
    assert first["long0"] == first["long1"] == 0  # the first two arrivals took the batch
    assert min(first[f"short{i}"] for i in range(4)) > 0
    order = sorted(first, key=lambda rid: (first[rid], list(reference).index(rid)))
    assert order == ["long0", "long1", "short0", "short1", "short2", "short3"]
    assert not preempted  # equal priorities never displace each other under fcfs, in any mode
    assert tokens == reference


def _stream_of_shorts(eng, until: int):
    """A short request arrives at every step below `until` (more than one slot can serve)."""
    def arrivals(step):
        if step < until:
            eng.add_request(f"s{step}", prompt(100 + step, 4), params(2))
    return arrivals


def test_aging_lets_a_long_request_in_within_its_bound(tiny_model_dir):
    """One slot, a long request waiting and a new short one every step: the long one's claim (8 prompt +
    24 output tokens = 32) is used up after 32 steps at aging 1 token/step; from then on only earlier
    arrivals go first, and it arrived first. With aging 100 times slower the same stream keeps it out."""
    eng = engine(tiny_model_dir, max_num_seqs=1, aging=1.0)
    eng.add_request("long", prompt(0), params(24))
    first, _, _, _ = run(eng, _stream_of_shorts(eng, until=80))
    assert 1 < first["long"] <= 32 + 2  # shorts went first, then its bound (+ the running short's 2 steps)

    slow = engine(tiny_model_dir, max_num_seqs=1, aging=0.01)
    slow.add_request("long", prompt(0), params(24))
    first, _, _, _ = run(slow, _stream_of_shorts(slow, until=80), max_steps=80)
    assert "long" not in first  # starved while shorts keep coming: aging is what let it in above


def test_preemption_guarantees_hold_under_srf(tiny_model_dir):
    """Long requests running when shorter ones keep arriving, on a tight KV pool with preemption on and
    the srf victim policy: there are preemptions, none beyond max_preemptions for a request, and every
    request finishes with exactly the tokens it makes alone."""
    eng = engine(tiny_model_dir, num_blocks=14, mode="on", kind="recompute", victim_policy="srf",
                 max_preemptions=2, max_num_seqs=4)
    alone = engine(tiny_model_dir, order="fcfs", mode="off", max_num_seqs=1)
    for e in (eng, alone):
        for i in range(3):
            e.add_request(f"long{i}", prompt(i), params(20))
    reference = run(alone, _arrive_shorts(alone))[2]
    first, done, tokens, preempted = run(eng, _arrive_shorts(eng))
    assert tokens == reference and len(done) == len(reference)
    assert preempted and max(preempted.values()) <= 2


def _arrive_shorts(eng):
    def arrivals(step):
        if 2 <= step < 14:
            eng.add_request(f"s{step}", prompt(200 + step, 6), params(3))
    return arrivals


def test_bad_order_or_aging_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match=r"scheduler.order 'sjf' is unknown; choose one of: srf, fcfs"):
        config_from_dict({"scheduler": {"order": "sjf"}})
    for bad in (0, -1.0):
        with pytest.raises(UserError, match=r"scheduler.aging must be > 0 tokens per step"):
            config_from_dict({"scheduler": {"aging": bad}})
    with pytest.raises(UserError, match=r"scheduler.aging must be a number"):
        config_from_dict({"scheduler": {"aging": "fast"}})
    f = tmp_path / "c.yaml"
    f.write_text("scheduler: {order: lifo}\n")
    with pytest.raises(UserError, match="scheduler.order 'lifo'"):
        load_config(f)
    assert load_config(None).scheduler.order == "srf"


# -- the scheduler alone (no model): who gets the prefill budget, who gives way --------------------
def scheduler(order="srf", num_blocks=64, **pre):
    return Scheduler(SchedulerConfig(order=order, max_num_seqs=4, max_prefill_tokens=8, max_num_batched_tokens=16),
                     BlockPool(num_blocks), 4, PreemptionConfig(min_exec_s=0, **pre), layout=KVLayout(2, 2048))


@pytest.mark.parametrize("order,first", [("srf", "short"), ("fcfs", "long")])
def test_the_prefill_budget_goes_to_the_least_remaining_work(order, first):
    """Budget for one prompt: srf gives it to the request with less work, fcfs to the first arrival."""
    s = scheduler(order)
    s.add(Request("long", [5] * 8, SamplingParams(max_tokens=50), arrival_time=0))
    s.add(Request("short", [5] * 8, SamplingParams(max_tokens=2), arrival_time=1))
    out = s.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [(first, 8)]


def _full_pool(spec):
    """Three requests decoding, 9 tokens known and 8 cached in 2 blocks each: the 6-block pool is full and
    each needs a block for its next token (the srf victim policy, nothing displaced; no deferral, which would
    keep the 100-token one out while the others run)."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_prefill_tokens=64, defer_ratio=0), BlockPool(6), 4,
                  PreemptionConfig(min_exec_s=0, mode="off", victim_policy="srf"), layout=KVLayout(2, 2048))
    reqs = [Request(f"r{i}", [5] * 7, SamplingParams(max_tokens=mt), arrival_time=i) for i, mt in enumerate(spec)]
    for r in reqs:
        s.add(r)
    s.schedule()  # admits all three
    for r in reqs:
        r.output_token_ids = [7, 7]
        s.kv.free(r)
        r.num_computed_tokens = 8
        assert len(s.kv.allocate_slots(r, 0)) == 2
    assert s.pool.num_free == 0
    return s, reqs


def test_srf_victim_is_the_largest_claim_and_aging_protects():
    """The srf victim is the request with the most work left, unless it has been in the engine so long
    that its claim ran out (it would be first in the queue again); then the next largest goes."""
    s, _ = _full_pool([100, 6, 10])
    assert s.schedule().preempted_ids == ["r0"]
    s, reqs = _full_pool([100, 6, 10])
    reqs[0].arrival_step = -1000  # arrived 1000 steps ago: its claim is 0
    assert s.schedule().preempted_ids == ["r2"]


@pytest.mark.parametrize("order,aged,displaced", [("srf", False, True), ("srf", True, False), ("fcfs", False, False)])
def test_displacement_follows_the_order(order, aged, displaced):
    """Preemption on: a short newcomer displaces a long running request under srf, not once the long one
    has aged out (its wait is bounded), and never under fcfs (equal priorities keep arrival order)."""
    s = Scheduler(SchedulerConfig(order=order, max_num_seqs=1), BlockPool(64), 4,
                  PreemptionConfig(mode="on", min_exec_s=0), layout=KVLayout(2, 2048))
    long = Request("long", [5] * 4, SamplingParams(max_tokens=100), arrival_time=0)
    s.add(long)
    s.schedule()
    if aged:
        long.arrival_step = -1000
    s.add(Request("short", [5] * 4, SamplingParams(max_tokens=2), arrival_time=1))
    out = s.schedule()
    assert (out.preempted_ids == ["long"]) is displaced


# -- deferral: a much larger request waits for a wide batch of smaller ones to narrow -----------------
def deferring(model_dir, ratio: float, min_running: int = 2, max_num_seqs: int = 4) -> LLMEngine:
    eng = engine(model_dir, max_num_seqs=max_num_seqs, mode="off")
    eng.config.scheduler.defer_ratio = ratio
    eng.config.scheduler.defer_min_running = min_running
    return eng


@pytest.mark.parametrize("ratio", [0.0, 2.0])
def test_a_long_request_joins_a_wide_batch_of_short_ones_only_once_it_narrows(tiny_model_dir, ratio):
    """Three shorts (8 + 3 tokens) and a long (8 + 24, over twice their size) with a free slot for each:
    without deferral the long takes its slot at once; with it, it waits while 2 or more shorts run and
    starts when the shorts finish. Outputs are the same tokens either way."""
    eng = deferring(tiny_model_dir, ratio)
    eng.add_request("long", prompt(0), params(24))
    for i in range(3):
        eng.add_request(f"short{i}", prompt(10 + i), params(3))
    first, done, tokens, _ = run(eng)
    shorts_done = max(done[f"short{i}"] for i in range(3))
    if ratio:
        assert first["long"] > shorts_done - 1  # admitted at the step the last shorts finished, not before
    else:
        assert first["long"] == 0
    alone = engine(tiny_model_dir, order="fcfs", mode="off", max_num_seqs=1)
    alone.add_request("long", prompt(0), params(24))
    assert tokens["long"] == run(alone)[2]["long"]


def test_deferral_keeps_the_aging_bound(tiny_model_dir):
    """Two short requests (4 + 2 tokens) at the start and one more every step, so 2+ always run and a slot
    is free: the long one (8 + 24 = 32 tokens, over twice a short's 6) is deferred until aging brings its
    claim under 2 x 6 = 12 (step 21), within its 32-step bound. A deferral without aging would keep it out
    for the whole stream."""
    eng = deferring(tiny_model_dir, ratio=2.0)
    for i in range(2):
        eng.add_request(f"first{i}", prompt(300 + i, 4), params(2))
    eng.add_request("long", prompt(0), params(24))
    first, _, _, _ = run(eng, _stream_of_shorts(eng, until=80))
    assert 32 - 12 <= first["long"] <= 32 + 2


def test_bad_deferral_is_a_clear_error():
    for bad in ({"defer_ratio": 1.0}, {"defer_ratio": -2}, {"defer_min_running": 0}):
        with pytest.raises(UserError, match=r"scheduler.defer_ratio must be 0 \(off\) or > 1"):
            config_from_dict({"scheduler": bad})
    assert config_from_dict({"scheduler": {"defer_ratio": 0}}).scheduler.defer_ratio == 0


# -- the critical lane: the largest request does not start last ---------------------------------------
def lane_burst(eng, longs=(24,)):
    """Longs (8 + n tokens) and ten shorts (8 + 3) waiting together, the longs first, in a batch of 8."""
    for i, n in enumerate(longs):
        eng.add_request(f"long{i}", prompt(i), params(n))
    for i in range(10):
        eng.add_request(f"short{i}", prompt(10 + i), params(3))


@pytest.mark.parametrize("lane", [True, False])
def test_the_largest_request_takes_one_slot_from_the_start(tiny_model_dir, lane):
    """With the lane, the largest waiting request starts at once beside seven shorts; the second long, no
    larger than it, waits for the shorts as srf and the deferral say. Without it both longs wait. The
    tokens are each request's own either way."""
    eng = engine(tiny_model_dir, max_num_seqs=8, mode="off")
    eng.config.scheduler.critical_lane = lane
    lane_burst(eng, longs=(24, 20))
    first, done, tokens, _ = run(eng)
    shorts_done = max(done[f"short{i}"] for i in range(10))
    assert (first["long0"] == 0) is lane
    assert first["long1"] >= shorts_done - 1
    assert min(first[f"short{i}"] for i in range(10)) == 0
    alone = engine(tiny_model_dir, order="fcfs", mode="off", max_num_seqs=1)
    lane_burst(alone, longs=(24, 20))
    assert tokens == run(alone)[2]


@pytest.mark.parametrize("case", ["narrow batch", "preemption on", "fcfs", "lower priority"])
def test_no_lane_where_it_would_cost_more_than_a_slot(tiny_model_dir, case):
    """No lane in a batch under 8 (one slot would be a large share of it), with preemption on (displacement
    would give the slot straight back), under fcfs (arrival decides), or for a larger request of lower
    priority than the queue's first (priority is never crossed)."""
    eng = engine(tiny_model_dir, max_num_seqs=4 if case == "narrow batch" else 8,
                 mode="on" if case == "preemption on" else "off", order="fcfs" if case == "fcfs" else "srf")
    for i in range(10):
        eng.add_request(f"short{i}", prompt(10 + i), params(3))
    eng.add_request("long0", prompt(0), params(24), priority=-1 if case == "lower priority" else 0)
    first, _, _, _ = run(eng)
    assert first["long0"] > 0  # the shorts' turn came first (with a lane it would start at step 0)

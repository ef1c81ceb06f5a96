"""Preemption end to end on a tiny model: every way a request can be paused and resumed gives
exactly the tokens of an uninterrupted greedy run (no numeric drift), and the moves really happen."""

from __future__ import annotations

import torch
import pytest

from gpuservd.config import EngineConfig, PreemptionConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.quota import TenantQuota
from gpuservd.engine.request import SamplingParams
from gpuservd.errors import UserError

PARAMS = dict(ignore_eos=True, detokenize=False)


def engine(model_dir, num_blocks=None, device="cpu", **pre) -> LLMEngine:
    sched = pre.pop("scheduler", {})
    cfg = EngineConfig(model="tiny", device=device, dtype="float32", block_size=4, kv_cache_bytes=4 << 20,
                       preemption=PreemptionConfig(min_exec_s=0, **pre))
    for k, v in sched.items():
        setattr(cfg.scheduler, k, v)
    if num_blocks:
        probe = LLMEngine("tiny", model_dir, cfg)
        cfg.kv_cache_bytes = num_blocks * probe.runner.cache.shape.bytes_per_block
    return LLMEngine("tiny", model_dir, cfg)


def prompts(n=4, length=14, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 290, (length + 3 * i,), generator=g).tolist() for i in range(n)]


def run(eng, ps, max_tokens=12):
    """generate(), plus every preemption and move the steps recorded."""
    first = eng.telemetry.num_steps
    out = eng.generate(ps, SamplingParams(max_tokens=max_tokens, **PARAMS))
    steps = eng.telemetry.recent()[first - eng.telemetry.num_steps:] if eng.telemetry.num_steps > first else []
    pre = [p for s in steps for p in s.preemptions]
    moves = [m for s in steps for m in s.swaps]
    return out, pre, moves


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    eng = engine(tiny_model_dir, mode="off")
    return eng.generate(prompts(), SamplingParams(max_tokens=12, **PARAMS))


@pytest.mark.parametrize("kind", ["swap", "partial_swap", "recompute"])
def test_memory_pressure_moves_are_exact(tiny_model_dir, reference, kind):
    # 4 requests of 14-23 prompt + 12 output tokens need 7-9 blocks each; 16 blocks force moves.
    eng = engine(tiny_model_dir, num_blocks=16, mode="on", kind=kind, partial_keep_fraction=0.34)
    out, pre, moves = run(eng, prompts())
    assert out == reference
    assert pre and {p["kind"] for p in pre} == {kind}
    if kind == "recompute":
        assert any(p["tokens_to_recompute"] > 0 for p in pre)
        # Some victim kept its newest blocks and dropped only the oldest ones
        # (the tokens farthest from the current step go first).
        assert any(0 < p["blocks_freed"] and p["tokens_to_recompute"] == 4 * p["blocks_freed"] for p in pre)
    else:
        outs = [m for m in moves if m["kind"] == "swap_out"]
        ins = [m for m in moves if m["kind"] == "swap_in"]
        assert outs and ins and all(m["bytes_moved"] > 0 for m in outs + ins)
        if kind == "partial_swap":
            assert all(m["host_layers"] == 2 and m["bytes_parked"] > 0 for m in outs)  # 1 of 3 layers kept
    assert eng.pool.num_free == eng.pool.num_blocks
    assert eng.host_pool.num_free == eng.host_pool.num_blocks


def test_partial_swap_frees_device_blocks(tiny_model_dir):
    """Parked layers are packed: a victim with n blocks keeps ceil(n * k / L) on the device."""
    eng = engine(tiny_model_dir, num_blocks=16, mode="on", kind="partial_swap", partial_keep_fraction=0.34)
    _, pre, moves = run(eng, prompts())
    outs = {m["request_id"]: m for m in moves if m["kind"] == "swap_out"}
    for p in pre:
        n = outs[p["request_id"]]["blocks"]
        assert p["blocks_freed"] == n - (-(-n // 3))


def swap_round_trip(model_dir, kind: str, device: str = "cpu"):
    """A request swapped out, every block it gave up overwritten (on CUDA while its host copies may still
    be in flight: finish() comes after), swapped back in. Returns (KV before, KV after, the moves)."""
    from gpuservd.engine.scheduler import SchedulerOutput

    eng = engine(model_dir, num_blocks=16, device=device, mode="on", kind=kind, partial_keep_fraction=0.34)
    eng.add_request("a", prompts(1, length=30)[0], SamplingParams(max_tokens=4, **PARAMS))
    eng.step()
    req, sched, kv = eng.requests["a"], eng.scheduler, eng.runner.cache.kv
    before = kv[:, :, sched.kv.table(req)].clone()
    out = SchedulerOutput(step_id=0)
    sched._preempt(req, out, need=1, reason="test")
    eng.swapper.execute(out.moves)
    parked = out.moves[0].park_blocks
    others = [b for b in range(eng.pool.num_blocks) if b not in parked]
    kv[:, :, others] = 7.0  # the freed blocks are reused by someone else
    eng.swapper.finish()
    back = SchedulerOutput(step_id=0)
    assert sched._resume(back, req, 1)
    eng.swapper.execute(back.moves)
    eng.swapper.finish()
    return before, kv[:, :, sched.kv.table(req)], out.moves + back.moves


@pytest.mark.parametrize("kind", ["swap", "partial_swap"])
def test_swap_in_restores_bytes_exactly(tiny_model_dir, kind):
    """The KV a swapped request gets back is bit-identical, even after its old blocks were overwritten."""
    before, after, moves = swap_round_trip(tiny_model_dir, kind)
    assert torch.equal(after, before) and moves


def test_displacement_by_priority_is_exact(tiny_model_dir, reference):
    """A high-priority arrival takes a running request's place (token granularity); both stay exact."""
    eng = engine(tiny_model_dir, mode="on", kind="swap", scheduler=dict(max_num_seqs=2))
    ps = prompts()
    p = SamplingParams(max_tokens=12, **PARAMS)
    eng.add_request("low0", ps[0], SamplingParams(**vars(p)))
    eng.add_request("low1", ps[1], SamplingParams(**vars(p)))
    got: dict[str, list[int]] = {"low0": [], "low1": [], "high": []}
    for _ in range(3):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    eng.add_request("high", ps[2], SamplingParams(**vars(p)), priority=5)
    o = eng.step()
    assert "high" in {x.request_id for x in o}  # admitted in the very next step
    rec = eng.telemetry.recent(1)[0]
    assert rec.preemptions and rec.preemptions[0]["reason"] == "displaced"
    for x in o:
        got[x.request_id] += x.new_token_ids
    while eng.has_unfinished():
        for x in eng.step():
            got[x.request_id] += x.new_token_ids
    assert [got["low0"], got["low1"], got["high"]] == reference[:3]


def test_off_never_displaces(tiny_model_dir):
    eng = engine(tiny_model_dir, mode="off", scheduler=dict(max_num_seqs=1))
    ps = prompts()
    eng.add_request("low", ps[0], SamplingParams(max_tokens=6, **PARAMS))
    eng.step()
    eng.add_request("high", ps[1], SamplingParams(max_tokens=6, **PARAMS), priority=9)
    eng.step()
    assert [r.request_id for r in eng.scheduler.running] == ["low"]


def test_shorter_request_displaces_long_one_at_equal_priority(tiny_model_dir):
    eng = engine(tiny_model_dir, mode="on", scheduler=dict(max_num_seqs=1))
    ps = prompts()
    eng.add_request("long", ps[0], SamplingParams(max_tokens=100, **PARAMS))
    eng.step()
    eng.add_request("short", ps[1], SamplingParams(max_tokens=5, **PARAMS))
    eng.step()
    assert [r.request_id for r in eng.scheduler.running] == ["short"]
    eng.add_request("medium", ps[2], SamplingParams(max_tokens=60, **PARAMS))  # not 4x shorter than long
    while eng.requests.get("short"):
        eng.step()
    eng.step()
    assert eng.scheduler.running[0].request_id in ("long", "medium")


def test_auto_mode_switches_on_skew_and_says_why(tiny_model_dir):
    eng = engine(tiny_model_dir, mode="auto", auto_min_samples=4, auto_window=8)
    assert not eng.scheduler.preemption_on
    ps = prompts(1)
    for n in (2, 2, 2, 2, 2, 2, 2, 40):  # P99/P50 = 20 > 5
        eng.generate(ps, SamplingParams(max_tokens=n, **PARAMS))
    assert eng.scheduler.preemption_on
    events = [e for s in eng.telemetry.recent() for e in s.events]
    on = [e for e in events if e.type == "preemption_mode"]
    assert on and on[-1]["enabled"] and on[-1]["ratio"] == 20.0 and on[-1]["p50"] == 2
    for _ in range(8):
        eng.generate(ps, SamplingParams(max_tokens=3, **PARAMS))
    assert not eng.scheduler.preemption_on
    events = [e for s in eng.telemetry.recent() for e in s.events]
    assert events[-1]["enabled"] is False


def test_tenant_quota_running_seqs_waits_without_blocking_others(tiny_model_dir):
    eng = engine(tiny_model_dir, mode="off")
    eng.set_tenant_quotas({"batch": TenantQuota(max_running_seqs=1)})
    ps = prompts()
    for i in range(3):
        eng.add_request(f"b{i}", ps[i], SamplingParams(max_tokens=4, **PARAMS), tenant="batch")
    eng.add_request("i0", ps[3], SamplingParams(max_tokens=4, **PARAMS), tenant="web")
    eng.step()
    running = sorted(r.request_id for r in eng.scheduler.running)
    assert running == ["b0", "i0"]
    while eng.has_unfinished():
        eng.step()
        assert sum(r.tenant == "batch" for r in eng.scheduler.running) <= 1


def test_tenant_kv_quota_rejects_what_can_never_fit(tiny_model_dir):
    eng = engine(tiny_model_dir)
    eng.set_tenant_quotas({"small": TenantQuota(max_kv_blocks=3)})
    with pytest.raises(UserError, match="tenant 'small' may hold 3"):
        eng.add_request("x", prompts(1)[0], SamplingParams(max_tokens=8), tenant="small")


def test_config_rejects_bad_preemption_settings():
    for bad, match in [(dict(mode="sometimes"), "auto, on, off"), (dict(granularity="step"), "request, token, layer"),
                       (dict(kind="teleport"), "swap"), (dict(memory_threshold=1.5), "memory_threshold")]:
        with pytest.raises(UserError, match=match):
            EngineConfig(preemption=PreemptionConfig(**bad)).validate()


def test_layer_suspend_serves_urgent_request_then_resumes_exactly(tiny_model_dir, reference):
    """granularity=layer: a prefill forward stops after its first layer when an urgent request is
    waiting; the urgent request runs alone next step; the suspended forward resumes at layer 1."""
    eng = engine(tiny_model_dir, mode="on", granularity="layer", scheduler=dict(max_prefill_tokens=64))
    ps = prompts()
    urgent: list = []
    calls: list[int] = []
    eng.interrupt = lambda prio: calls.append(prio) or any(p > prio for p in urgent)
    got: dict[str, list[int]] = {"bulk": [], "vip": []}
    eng.add_request("bulk", ps[0], SamplingParams(max_tokens=12, **PARAMS))
    urgent.append(5)  # arrives while bulk's prefill runs
    assert eng.step() == []  # suspended after layer 0
    assert eng._suspended is not None and eng._suspended.checkpoint.next_layer == 1
    urgent.clear()
    eng.add_request("vip", ps[1], SamplingParams(max_tokens=12, **PARAMS), priority=5)
    outs = eng.step()  # vip's prefill alone, bulk untouched
    assert [o.request_id for o in outs] == ["vip"]
    outs += eng.step()  # bulk's forward resumes at layer 1 and samples its first token
    assert "bulk" in {o.request_id for o in outs}
    for o in outs:
        got[o.request_id] += o.new_token_ids
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert [got["bulk"], got["vip"]] == reference[:2]
    kinds = [e.type for s in eng.telemetry.recent() for e in s.events]
    assert kinds[:2] == ["layer_suspend", "layer_resume"]
    assert calls and eng.pool.num_free == eng.pool.num_blocks


def test_abort_of_a_suspended_request_finishes_its_forward_first(tiny_model_dir):
    eng = engine(tiny_model_dir, mode="on", granularity="layer", scheduler=dict(max_prefill_tokens=64))
    ps = prompts()
    eng.interrupt = lambda prio: True
    eng.add_request("a", ps[0], SamplingParams(max_tokens=5, **PARAMS))
    eng.add_request("b", ps[1], SamplingParams(max_tokens=5, **PARAMS))
    assert eng.step() == [] and eng._suspended is not None
    out = eng.abort("a")
    assert out.finished and eng._suspended is None
    nxt = eng.step()
    assert "b" in {o.request_id for o in nxt}  # b's token from the finished forward is not lost
    eng.interrupt = None
    while eng.has_unfinished():
        eng.step()
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize("mode", ["on", "off"])
def test_memory_quota_moves_out_the_models_own_requests(tiny_model_dir, reference, mode):
    """Lowering the pool's capacity (a memory quota) mid-run makes the engine move its own running
    requests out (reason quota), whatever the preemption mode; the tokens stay exact, nothing leaks."""
    eng = engine(tiny_model_dir, num_blocks=64, mode=mode, kind="swap")
    ps = prompts(4)
    params = SamplingParams(max_tokens=12, **PARAMS)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params)
    outs, quota = {}, []
    for _ in range(2):
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    eng.pool.set_limit(eng.pool.num_used // 2)
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        rec = eng.telemetry.recent()[-1]
        quota += [p for p in rec.preemptions if p["reason"] == "quota"]
        assert eng.pool.num_used <= eng.pool.capacity
    assert quota, "no request was moved for the quota"
    assert {p["kind"] for p in quota} <= ({"swap", "partial_swap", "recompute"} if mode == "on" else {"recompute"})
    assert [outs[f"r{i}"] for i in range(4)] == reference
    assert eng.pool.num_free == eng.pool.capacity and eng.host_pool.num_used == 0
    eng.pool.set_limit(None)
    assert eng.pool.capacity == eng.pool.num_blocks

"""Overlap (engine/overlap.py) on the CPU: decode step N+1 is scheduled and launched before step N's ids
are read, its rows taking their tokens from step N's choice on the device; the tokens are those of the
engine without overlap, through stops, aborts, arrivals and preemption; KV blocks all come back."""

from __future__ import annotations

import pytest

from gpuservd.config import EngineConfig, config_from_dict
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.overlap import PENDING
from gpuservd.engine.request import SamplingParams
from gpuservd.errors import UserError
from test_preemption import PARAMS, engine, prompts, run

MIXED = [dict(max_tokens=9), dict(max_tokens=7, temperature=0.9, top_p=0.9, seed=5),
         dict(max_tokens=11, temperature=1.1, top_k=30, seed=6), dict(max_tokens=4), dict(max_tokens=8, seed=1)]


def overlapped(eng: LLMEngine, sizes=(1, 2, 4, 8)) -> LLMEngine:
    eng.runner.enable_decode_step(sizes)
    eng.overlap = True
    return eng


def drive(eng, ps, params, late=None):
    """Run to completion; late = (after this many steps, prompt, params): a request arriving mid-run."""
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(f"r{i}", p, sp)
    got, reasons, steps = {}, {}, 0
    while eng.has_unfinished():
        if late is not None and steps == late[0]:
            eng.add_request("late", late[1], late[2])
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert PENDING not in o.new_token_ids
            if o.finished:
                reasons[o.request_id] = (o.finish_reason, o.num_output_tokens)
        steps += 1
    return got, reasons


def traced(eng):
    """Log the order of the host's scheduling, the decode steps' launches and the reads of their ids."""
    log = []
    sched, step = eng.scheduler, eng.runner.decode_step
    real_schedule, real_run = sched.schedule, step.run

    def schedule():
        log.append(("schedule",))
        return real_schedule()

    def launch(*a, **kw):
        result = real_run(*a, **kw)
        k = sum(e[0] == "launch" for e in log)
        log.append(("launch", k))
        real_host = result.host
        result.host = lambda: log.append(("read", k)) or real_host()
        return result

    sched.schedule, step.run = schedule, launch
    return log


def reads_after_next_launch(log) -> int:
    """Reads of step k's ids that came after step k + 1 was scheduled and launched."""
    at = {e: i for i, e in enumerate(log)}
    n = 0
    for (what, *k), i in at.items():
        if what == "read" and ("launch", k[0] + 1) in at and at["launch", k[0] + 1] < i:
            before = [j for j, e in enumerate(log) if e == ("schedule",) and at["launch", k[0]] < j < at["launch", k[0] + 1]]
            assert before, "the launch of step k + 1 came without a schedule after step k's"
            n += 1
    return n


def test_tokens_equal_without_overlap_and_step_n_plus_1_starts_before_step_n_is_read(tiny_model_dir, ops):
    ps = prompts(n=5, length=5)
    params = [SamplingParams(**PARAMS, **m) for m in MIXED]
    free = engine(tiny_model_dir).generate(ps[:2], SamplingParams(max_tokens=8, **PARAMS))
    params[0].stop_token_ids = [free[0][3]]  # stops early, while its next step is already launched
    want = drive(engine(tiny_model_dir), ps, params)
    plain = overlapped(engine(tiny_model_dir))
    plain.overlap = False
    plain_log = traced(plain)
    assert drive(plain, ps, params) == want
    assert reads_after_next_launch(plain_log) == 0  # without overlap each step is read before the next
    eng = overlapped(engine(tiny_model_dir))
    log = traced(eng)
    got = drive(eng, ps, params)
    assert got == want and want[1]["r0"][0].value == "stop"
    launches = sum(e[0] == "launch" for e in log)
    assert reads_after_next_launch(log) >= launches - 3  # all but the few steps after a prefill
    assert eng.pool.num_free == eng.pool.capacity and not eng.requests


def test_a_request_arriving_mid_run_and_one_aborted_in_flight(tiny_model_dir, ops):
    ps = prompts(n=3, length=6)
    params = [SamplingParams(**PARAMS, **m) for m in MIXED[:3]]
    late = (4, prompts(n=1, length=9, seed=3)[0], SamplingParams(max_tokens=6, temperature=0.8, seed=9, **PARAMS))
    want = drive(engine(tiny_model_dir), ps, params, late)
    eng = overlapped(engine(tiny_model_dir))
    assert drive(eng, ps, params, late) == want
    # An abort while a step of the request is in flight: its output has what was read, nothing pending.
    eng.add_request("a", ps[0], SamplingParams(max_tokens=20, **PARAMS))
    eng.add_request("b", ps[1], SamplingParams(max_tokens=20, **PARAMS))
    seen = []
    for _ in range(5):
        seen += [t for o in eng.step() if o.request_id == "a" for t in o.new_token_ids]
    assert eng._inflight is not None and eng.requests["a"].output_token_ids[-1] == PENDING
    out = eng.abort("a")
    assert out.finished and out.num_output_tokens == len(seen) and PENDING not in eng.requests.get("b").output_token_ids[:-1]
    while eng.has_unfinished():
        eng.step()
    assert eng.pool.num_free == eng.pool.capacity


@pytest.mark.parametrize("kind", ["recompute", "swap"])
def test_preemption_under_overlap_keeps_the_tokens(tiny_model_dir, ops, kind):
    ref = engine(tiny_model_dir, mode="off").generate(prompts(), SamplingParams(max_tokens=12, **PARAMS))
    eng = overlapped(engine(tiny_model_dir, num_blocks=16, mode="on", kind=kind), sizes=(1, 2, 4))
    out, pre, _ = run(eng, prompts())
    assert out == ref and pre and {p["kind"] for p in pre} == {kind}
    assert eng.pool.num_free == eng.pool.capacity


def test_overlap_setting(tiny_model_dir, ops):
    with pytest.raises(UserError, match=r"^engine\.overlap must be true or false, got 'yes'$"):
        config_from_dict({"engine": {"overlap": "yes"}}).validate()
    cfg = EngineConfig(model="tiny", block_size=4, kv_cache_bytes=4 << 20)
    eng = LLMEngine("tiny", tiny_model_dir, cfg)
    assert eng.overlap is False and eng.decode_status()["overlap"] is False  # CPU default: off
    cfg.overlap = True
    eng = LLMEngine("tiny", tiny_model_dir, cfg)
    assert eng.overlap and eng.decode_status()["overlap"] is False  # asked, but no fixed-shape step to chain
    eng.runner.enable_decode_step([1, 2])
    assert eng.decode_status()["overlap"] is True

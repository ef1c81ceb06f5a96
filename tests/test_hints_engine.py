"""Hint rules fired by real engines: each test builds a tiny random Llama, gives it the pressure the rule is
about (a KV pool too small for the running set, a queue of thousands, repeated prompt prefixes with the prefix
cache off, a decode batch past a real sweep's plateau), and feeds the engine's own step records through the
daemon's HintMonitor exactly as the daemon's event bus does (each StepRecord, then `detail_events`: its
preemptions and swaps as events of their own). The same workloads without the pressure must leave the rule quiet.

Where each of the 13 rules fires from real records:
- here (engine): swap_thrash, scheduler_overhead, prefix_caching_off_repeats, batch_past_plateau;
- tests/test_hints_daemon.py (a spawned daemon): preemption_off_skewed, kv_quota_small, starvation;
- tests/test_hints_serving.py (the daemon's Serving in-process): cache_hit_rate_low, load_after_evict;
- tests/test_hints_sharing.py (the daemon's Serving in-process, two models under the arbiter):
  sharing_contention.

Not produced on a CPU, and why:
- bandwidth_bound reads SM utilisation (NVML `utilization.gpu` or GPM SM activity): a CPU has no such reading
  (status.device.readings carries it as null with a reason), so the rule's input is unfed, as
  test_hints_daemon checks.
- device_errors reads NVML health and Xid error counters or `device_error` events: there is no NVML on a CPU,
  and even on a GPU an Xid cannot be caused on purpose by a test.
- timeslice_overhead fires when handoffs take over 5% of contended time. On a CPU a handoff is one thread
  waking another (about 0.1 ms against a quantum of at least 10 ms: 1%); it passes 5% only when an
  oversubscribed machine delays the woken thread, which no setting produces on purpose (the rule's docstring
  has the numbers). test_hints_sharing shows it fed by real time slices and quiet.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from gpuservd.bench.sweep import run_sweep
from gpuservd.config import EngineConfig, PreemptionConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.step_events import detail_events
from gpuservd.engine.request import SamplingParams
from gpuservd.hints.monitor import HintMonitor
from gpuservd.hints.sweeps import latest_sweep
from gpuservd.hints.window import pct


FIRED_FROM_REAL_RECORDS = {
    "test_hints_engine": {"swap_thrash", "scheduler_overhead", "prefix_caching_off_repeats", "batch_past_plateau"},
    "test_hints_daemon": {"preemption_off_skewed", "kv_quota_small", "starvation"},
    "test_hints_serving": {"cache_hit_rate_low", "load_after_evict"},
    "test_hints_sharing": {"sharing_contention"},
}
NOT_ON_A_CPU = {"bandwidth_bound", "device_errors", "timeslice_overhead"}  # why: the docstring


def test_every_rule_fires_from_real_records_somewhere_or_says_why_not():
    from gpuservd.hints.monitor import ALL_RULES

    fired = set().union(*FIRED_FROM_REAL_RECORDS.values())
    assert fired | NOT_ON_A_CPU == {r.name for r in ALL_RULES} and not fired & NOT_ON_A_CPU
    for module, names in FIRED_FROM_REAL_RECORDS.items():  # each module really asserts its rules' hints
        text = (Path(__file__).parent / f"{module}.py").read_text()
        assert all(f'"{n}"' in text for n in names), module


def engine(model_dir, num_blocks=None, engine_kw=None, scheduler=None, **pre) -> LLMEngine:
    cfg = EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=4, kv_cache_bytes=4 << 20,
                       num_threads=1, preemption=PreemptionConfig(**pre), **(engine_kw or {}))
    for k, v in (scheduler or {}).items():
        setattr(cfg.scheduler, k, v)
    if num_blocks:
        probe = LLMEngine("tiny", model_dir, cfg)
        cfg.kv_cache_bytes = num_blocks * probe.runner.cache.shape.bytes_per_block
    return LLMEngine("tiny", model_dir, cfg)


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False)


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 290) for _ in range(length + i % 5)] for i in range(n)]


def verdicts(eng: LLMEngine, sweeps: dict | None = None) -> dict[str, dict]:
    """The daemon's monitor over this engine's step records (and the events the daemon derives from each):
    the active hints by name, as /admin/status lists them."""
    mon = HintMonitor()
    for rec in eng.telemetry.recent():
        mon.observe(rec)
        for event in detail_events(rec):
            mon.observe(event)
    models = {eng.name: {"preemption": eng.preemption_status(), "max_num_seqs": eng.config.scheduler.max_num_seqs}}
    mon.evaluate(time.time(), models, sweeps)
    hints = {h["name"]: h for h in mon.hints()}
    for h in hints.values():
        assert h["model"] == eng.name and h["symptom"] and h["cause"] and h["action"]
    return hints


# ---- swap_thrash ----------------------------------------------------------------------------------------

def test_swap_thrash_fires_when_the_pool_cannot_hold_the_running_set(tiny_model_dir):
    # 12 requests of 12-16 prompt + 40 output tokens need 13-14 blocks each; 24 blocks hold fewer than two, so
    # swapped requests come back and are swapped out again within seconds.
    eng = engine(tiny_model_dir, num_blocks=24, mode="on", kind="swap", min_exec_s=0,
                 scheduler={"max_num_seqs": 8})
    eng.generate(prompts(12, 12), params(40))
    moves = [m for r in eng.telemetry.recent() for m in r.swaps]
    assert moves and {m["direction"] for m in moves} == {"out", "in"}
    ev = verdicts(eng)["swap_thrash"]["evidence"]
    assert ev["num_cycles"] >= 2 and ev["worst_cycles"] >= 1 and ev["num_requests"] >= 1
    assert ev["worst_request"].startswith("gen-")
    assert ev["bytes_moved"] == sum(m["bytes_moved"] for m in moves) > 0
    assert ev["memory_threshold"] == 0.85 and 0 <= ev["swap_share"] <= 1


def test_swap_thrash_quiet_when_the_pool_holds_everyone(tiny_model_dir):
    eng = engine(tiny_model_dir, mode="on", kind="swap", min_exec_s=0, scheduler={"max_num_seqs": 8})
    eng.generate(prompts(12, 12), params(40))
    assert not any(r.swaps for r in eng.telemetry.recent())
    assert "swap_thrash" not in verdicts(eng)


# ---- scheduler_overhead ---------------------------------------------------------------------------------

def queued(model_dir, n: int) -> LLMEngine:
    """One running sequence at a time and n requests queued: every step's decision orders the whole queue."""
    eng = engine(model_dir, mode="off", scheduler={"max_num_seqs": 1})
    for i, p in enumerate(prompts(n, 4)):
        eng.add_request(f"r{i}", p, params(2))
    for _ in range(40):
        eng.step()
    return eng


def test_scheduler_overhead_fires_on_a_queue_of_thousands(tiny_model_dir):
    eng = queued(tiny_model_dir, 2000)
    ev = verdicts(eng)["scheduler_overhead"]["evidence"]
    recs = eng.telemetry.recent()
    share = pct([r.decision_s / r.wall_s for r in recs], 50)  # the median step's share (nearest rank)
    assert ev["decision_share"] == pytest.approx(share, abs=1e-3) and ev["decision_share"] > ev["threshold"] == 0.1
    assert ev["num_steps"] == 40 and ev["waiting_mean"] > 1900


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory):
    """A tiny model of 16 wider layers: a forward of a few ms, as a real model's is long against its decision.
    The tiny width is not enough: with every layer in one C++ op its 16-layer step takes ~0.5 ms, and the
    ~0.05 ms decision is 10% of that, the rule's threshold (it fired in 3 of 3 quiet runs); at width 256 a
    step takes ~2.5 ms and the decision ~4%."""
    from factories import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("deep-llama"), num_hidden_layers=16, hidden_size=256,
                          intermediate_size=512)


def test_scheduler_overhead_quiet_on_a_short_queue(deep_model_dir):
    eng = engine(deep_model_dir, mode="off", scheduler={"max_num_seqs": 4})
    eng.generate(prompts(8, 4), params(12))
    assert len(eng.telemetry.recent()) >= 20  # enough steps for a verdict
    assert "scheduler_overhead" not in verdicts(eng)


# ---- prefix_caching_off_repeats -------------------------------------------------------------------------

def shared_prefix_prompts(n=12, prefix=40, seed=1):
    rng = random.Random(seed)
    system = [rng.randrange(3, 290) for _ in range(prefix)]
    return [system + [rng.randrange(3, 290) for _ in range(4)] for _ in range(n)]


def test_prefix_caching_off_repeats_fires_on_a_shared_system_prompt(tiny_model_dir):
    eng = engine(tiny_model_dir, mode="off", engine_kw={"prefix_caching": False}, scheduler={"max_num_seqs": 4})
    eng.generate(shared_prefix_prompts(), params(4))
    ev = verdicts(eng)["prefix_caching_off_repeats"]["evidence"]
    recs = eng.telemetry.recent()
    assert ev["repeat_tokens"] == sum(r.num_prefix_repeat_tokens for r in recs) >= 256
    assert ev["prefill_tokens"] == sum(r.num_prefill_tokens for r in recs) == 12 * 44
    assert ev["repeat_share"] >= 0.3 and ev["threshold"] == 0.3


@pytest.mark.parametrize("case", ["caching_on", "distinct_prompts"])
def test_prefix_caching_off_repeats_quiet(tiny_model_dir, case):
    on = case == "caching_on"
    eng = engine(tiny_model_dir, mode="off", engine_kw={"prefix_caching": on}, scheduler={"max_num_seqs": 4})
    eng.generate(shared_prefix_prompts() if on else prompts(12, 44, seed=2), params(4))
    if on:
        assert sum(r.num_prefix_hit_tokens for r in eng.telemetry.recent()) > 0  # the cache did reuse them
    assert "prefix_caching_off_repeats" not in verdicts(eng)


# ---- batch_past_plateau ---------------------------------------------------------------------------------

@pytest.fixture
def swept_tiny(store_home, tmp_path):
    """A real `gpuserv bench sweep` of the tiny model over batches 1 and 2: its plateau is 1 or 2."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("engine:\n  kv_cache_bytes: 4MiB\n  block_size: 4\n  num_threads: 1\n")
    run_sweep("tiny", cfg, batches=(1, 2), prompt_tokens=8, prefill_chunk=16, steps=2, out_dir=tmp_path / "sweep",
              log=lambda *a: None)
    sweep = latest_sweep("tiny")
    assert sweep["plateau_batch"] in (1, 2)
    return sweep


def test_batch_past_plateau_fires_on_a_batch_of_16(tiny_model_dir, swept_tiny):
    eng = engine(tiny_model_dir, mode="off", scheduler={"max_num_seqs": 16})
    eng.generate(prompts(16, 6), params(30))
    ev = verdicts(eng, {"tiny": swept_tiny})["batch_past_plateau"]["evidence"]
    assert ev["decode_batch_p50"] == 16 and ev["plateau_batch"] == swept_tiny["plateau_batch"]
    assert ev["max_num_seqs"] == 16 and ev["sweep"].endswith("sweeps/tiny.json")
    assert ev["recommended_decode_heavy"] == swept_tiny["recommended"]["decode_heavy"]
    assert ev["tokens_s_at_plateau"] is not None


def test_batch_past_plateau_quiet_at_the_plateau(tiny_model_dir, swept_tiny):
    eng = engine(tiny_model_dir, mode="off", scheduler={"max_num_seqs": 1})
    eng.generate(prompts(2, 6), params(30))
    assert "batch_past_plateau" not in verdicts(eng, {"tiny": swept_tiny})

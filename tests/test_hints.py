"""Every hint rule on hand-built telemetry windows: one that must fire it (checking the evidence numbers)
and one that must not; plus the monitor (activation, deactivation, missing inputs)."""

from __future__ import annotations

import pytest

from gpuservd.hints.monitor import ALL_RULES, HintMonitor
from gpuservd.hints.rule import Thresholds, missing_inputs
from gpuservd.hints.rules_cache import cache_hit_rate_low, load_after_evict, lru_hit_rate, lru_size_for
from gpuservd.hints.rules_device import bandwidth_bound, device_errors, sharing_contention, timeslice_overhead
from gpuservd.hints.rules_sched import (batch_past_plateau, kv_quota_small, preemption_off_skewed,
                                        prefix_caching_off_repeats, scheduler_overhead, starvation, swap_thrash)
from gpuservd.hints.window import Window

NOW = 1000.0
TH = Thresholds()


def step(t, model="m", wall=0.01, decision=0.001, prefill=0, decode=4, running=4, waiting=0, used=10, total=100,
         preemption_on=False, swap_s=0.0) -> dict:
    return {"type": "step", "model": model, "t": t, "wall_s": wall, "forward_s": wall * 0.8, "decision_s": decision,
            "num_prefill_tokens": prefill, "num_decode_tokens": decode, "num_running": running,
            "num_waiting": waiting, "kv_blocks_used": used, "kv_blocks_total": total, "preemption_on": preemption_on,
            "swap_s": swap_s, "preempted_ids": [], "preemptions": [], "swaps": [], "events": []}


def steps(n=30, **kw) -> list[dict]:
    return [step(NOW - 20 + 0.5 * i, **kw) for i in range(n)]


def finished(t, out, model="m", **kw) -> dict:
    return {"type": "request_finished", "t": t, "model": model, "status": 200, "num_prompt_tokens": 8,
            "num_output_tokens": out, "e2e_s": 1.0, **kw}


def window(**kw) -> Window:
    return Window(NOW, **kw)


def test_every_rule_has_a_test_here():
    tested = {"preemption_off_skewed", "starvation", "swap_thrash", "kv_quota_small", "scheduler_overhead",
              "batch_past_plateau", "bandwidth_bound", "device_errors", "timeslice_overhead", "sharing_contention",
              "cache_hit_rate_low", "load_after_evict", "prefix_caching_off_repeats"}
    assert {r.name for r in ALL_RULES} == tested


# ---- scheduling rules (fed by this daemon) ------------------------------------------------------------

def skewed_requests(n_short=27, n_long=3):
    return [finished(NOW - 60 + i, 10) for i in range(n_short)] + [finished(NOW - 20 + i, 200) for i in range(n_long)]


def test_preemption_off_skewed_fires_with_evidence():
    w = window(events=skewed_requests(), steps={"m": steps()}, models={"m": {"preemption": {"mode": "off"}}})
    ev = preemption_off_skewed(w, "m", TH)
    assert ev == {"output_p50": 10.0, "output_p99": 200.0, "ratio": 20.0, "threshold": 5.0, "num_requests": 30,
                  "mode": "off"}


@pytest.mark.parametrize("case", ["preemption_on", "uniform", "too_few"])
def test_preemption_off_skewed_quiet(case):
    events = skewed_requests()
    models = {"m": {"preemption": {"mode": "off"}}}
    if case == "preemption_on":
        models = {"m": {"preemption": {"mode": "auto", "enabled": True}}}
    elif case == "uniform":
        events = [finished(NOW - 30 + i, 40 + i % 3) for i in range(30)]
    else:
        events = skewed_requests(15, 3)
    assert preemption_off_skewed(window(events=events, steps={"m": steps()}, models=models), "m", TH) is None


def preemption(t, *ids, model="m"):
    return {"type": "preemption", "t": t, "model": model, "request_ids": list(ids),
            "victims": [{"request_id": i, "kind": "recompute", "reason": "memory"} for i in ids]}


def test_starvation_fires_on_a_request_preempted_three_times():
    events = [preemption(NOW - 50, "r1", "r2"), preemption(NOW - 30, "r1"), preemption(NOW - 10, "r1")]
    w = window(events=events, models={"m": {"preemption": {"victim_policy": "most_remaining"}}})
    assert starvation(w, "m", TH) == {"request_id": "r1", "num_preemptions": 3, "num_starved": 1, "threshold": 3,
                                      "span_s": 120.0, "victim_policy": "most_remaining"}


def test_starvation_quiet_when_spread_or_old():
    events = [preemption(NOW - 500, "r1"), preemption(NOW - 30, "r1"), preemption(NOW - 10, "r1", "r2")]
    assert starvation(window(events=events), "m", TH) is None


def swap(t, kind, rid="r1", nbytes=1000):
    return {"type": "swap", "t": t, "model": "m", "kind": kind, "request_id": rid, "bytes_moved": nbytes,
            "seconds": 0.001}


def test_swap_thrash_counts_out_in_out_cycles():
    events = [swap(NOW - 20, "swap_out"), swap(NOW - 19, "swap_in"), swap(NOW - 16, "swap_out"),
              swap(NOW - 15, "swap_in"), swap(NOW - 13, "swap_out")]
    w = window(events=events, steps={"m": steps(20, wall=0.01, swap_s=0.002)},
               models={"m": {"preemption": {"memory_threshold": 0.85}}})
    assert swap_thrash(w, "m", TH) == {"num_cycles": 2, "num_requests": 1, "worst_request": "r1", "worst_cycles": 2,
                                       "bytes_moved": 5000, "swap_share": 0.2, "memory_threshold": 0.85}


def test_swap_thrash_quiet_when_requests_stay_in():
    events = [swap(NOW - 60, "swap_out"), swap(NOW - 59, "swap_in"), swap(NOW - 30, "swap_out"),
              swap(NOW - 29, "swap_in"), swap(NOW - 2, "swap_out")]  # back in for 29 s each time
    assert swap_thrash(window(events=events, steps={"m": steps()}), "m", TH) is None


def test_kv_quota_small_fires_with_a_sizing():
    w = window(steps={"m": steps(used=96, total=100, running=4, waiting=8)})
    assert kv_quota_small(w, "m", TH) == {"kv_use_p50": 0.96, "full_steps_share": 1.0, "waiting_mean": 8.0,
                                          "waiting_max": 8, "kv_blocks_total": 100, "kv_blocks_wanted": 288,
                                          "scale": 2.88, "num_steps": 30}


@pytest.mark.parametrize("kw", [dict(used=96, waiting=1), dict(used=60, waiting=8)])
def test_kv_quota_small_quiet(kw):
    assert kv_quota_small(window(steps={"m": steps(**kw)}), "m", TH) is None


def test_scheduler_overhead_fires_on_decision_share():
    w = window(steps={"m": steps(wall=0.01, decision=0.002)})
    assert scheduler_overhead(w, "m", TH) == {"decision_share": 0.2, "threshold": 0.1, "decision_ms_p50": 2.0,
                                              "step_ms_p50": 10.0, "num_steps": 30, "waiting_mean": 0.0}


def test_scheduler_overhead_quiet():
    assert scheduler_overhead(window(steps={"m": steps(wall=0.01, decision=0.0005)}), "m", TH) is None
    assert scheduler_overhead(window(steps={"m": steps(5, decision=0.009)}), "m", TH) is None  # too few steps
    ss = steps(wall=0.01, decision=0.0005)
    ss[3].update(decision_s=0.2, wall_s=0.21)  # one decision the OS descheduled: 41% of the window's time
    assert scheduler_overhead(window(steps={"m": ss}), "m", TH) is None


SWEEP = {"plateau_batch": 8, "points": [{"batch": b, "tokens_s": s} for b, s in
                                        ((1, 100), (2, 190), (4, 350), (8, 600), (16, 640), (32, 650))],
         "recommended": {"decode_heavy": 8, "prefill_heavy": 4}, "path": "/x/m.json"}


def test_batch_past_plateau_fires_past_the_sweep_plateau():
    w = window(steps={"m": steps(decode=32, running=32)}, sweeps={"m": SWEEP}, models={"m": {"max_num_seqs": 64}})
    assert batch_past_plateau(w, "m", TH) == {
        "decode_batch_p50": 32.0, "plateau_batch": 8, "max_num_seqs": 64, "tokens_s_at_plateau": 600.0,
        "tokens_s_at_batch": 650.0, "recommended_decode_heavy": 8, "recommended_prefill_heavy": 4, "sweep": "/x/m.json"}


def test_batch_past_plateau_quiet_at_the_plateau_or_without_a_sweep():
    assert batch_past_plateau(window(steps={"m": steps(decode=8)}, sweeps={"m": SWEEP}), "m", TH) is None
    w = window(steps={"m": steps(decode=32)})
    assert batch_past_plateau(w, "m", TH) is None
    rule = next(r for r in ALL_RULES if r.name == "batch_past_plateau")
    assert missing_inputs(rule, w) == ["a `gpuserv bench sweep --model M` result for the served model"]


def test_prefix_caching_off_repeats_fires_when_prompts_repeat():
    ss = steps(prefill=100)
    for s in ss[:10]:
        s.update(num_prefix_repeat_tokens=64, prefix_caching=False)
    assert prefix_caching_off_repeats(window(steps={"m": ss}), "m", TH) is None  # 640 of 3000: under 0.3
    for s in ss[:20]:
        s.update(num_prefix_repeat_tokens=64)
    ev = prefix_caching_off_repeats(window(steps={"m": ss}), "m", TH)
    assert ev == {"repeat_tokens": 1280, "prefill_tokens": 3000, "repeat_share": 0.427, "threshold": 0.3,
                  "num_steps": 30}


def test_prefix_caching_off_repeats_quiet_with_caching_on_or_distinct_prompts():
    ss = steps(prefill=100)
    assert prefix_caching_off_repeats(window(steps={"m": ss}), "m", TH) is None  # nothing repeated
    for s in ss:
        s.update(num_prefix_repeat_tokens=90, prefix_caching=True)
    assert prefix_caching_off_repeats(window(steps={"m": ss}), "m", TH) is None  # the cache is on


# ---- device rules ---------------------------------------------------------------------------------------

def readings(**kw):
    return [{"t": NOW - 10 + i, **kw} for i in range(5)]


def test_bandwidth_bound_fires_on_low_sm_and_slow_steps():
    w = window(readings=readings(sm_util_pct=30, mem_bw_util_pct=85), steps={"m": steps(wall=0.08)})
    assert bandwidth_bound(w, "m", TH) == {"sm_util_pct": 30.0, "mem_bw_util_pct": 85.0, "step_ms_p50": 80.0,
                                           "num_steps": 30, "num_readings": 5}


@pytest.mark.parametrize("kw,wall", [(dict(sm_util_pct=90, mem_bw_util_pct=85), 0.08),
                                     (dict(sm_util_pct=30, mem_bw_util_pct=85), 0.01),
                                     (dict(sm_util_pct=30, mem_bw_util_pct=20), 0.08)])
def test_bandwidth_bound_quiet(kw, wall):
    assert bandwidth_bound(window(readings=readings(**kw), steps={"m": steps(wall=wall)}), "m", TH) is None


def test_bandwidth_bound_says_it_has_no_readings_here():
    w = window(steps={"m": steps(wall=0.08)})
    assert bandwidth_bound(w, "m", TH) is None
    rule = next(r for r in ALL_RULES if r.name == "bandwidth_bound")
    assert "sm_util_pct" in missing_inputs(rule, w)[0]


def test_device_errors_fires_on_new_xids():
    rs = [{"t": NOW - 20, "xid_errors_total": 1, "health": "ok"}, {"t": NOW - 1, "xid_errors_total": 3, "health": "ok"}]
    events = [{"type": "device_error", "t": NOW - 2, "xid": 79, "message": "GPU has fallen off the bus"}]
    assert device_errors(window(readings=rs, events=events), None, TH) == {
        "xid_errors": 2, "health": "ok", "num_error_events": 1, "last_xid": 79,
        "last_error": "GPU has fallen off the bus"}


def test_device_errors_quiet_when_counters_stand_still():
    rs = [{"t": NOW - 20, "xid_errors_total": 3, "health": "ok"}, {"t": NOW - 1, "xid_errors_total": 3, "health": "ok"}]
    assert device_errors(window(readings=rs), None, TH) is None


def slices(switch_s, n=25):
    return [{"type": "time_slice", "t": NOW - 10 + 0.1 * i, "device": "cuda:0", "quantum_ms": 20, "run_s": 0.019,
             "switch_s": switch_s} for i in range(n)]


def test_timeslice_overhead_fires_above_five_percent():
    assert timeslice_overhead(window(events=slices(0.0015)), None, TH) == {
        "overhead_share": 0.073, "threshold": 0.05, "quantum_ms": 20, "switch_ms_p50": 1.5, "num_slices": 25}


def test_timeslice_overhead_quiet():
    assert timeslice_overhead(window(events=slices(0.0005)), None, TH) is None
    assert timeslice_overhead(window(events=slices(0.01, n=5)), None, TH) is None  # too few slices


def shared_window(shared_wall, classes=None):
    alone = [step(NOW - 29 + 0.1 * i, model="small", wall=0.01) for i in range(25)]
    shared = [step(NOW - 20 + 0.1 * i, model="small", wall=shared_wall) for i in range(25)]
    big = [step(NOW - 17, model="big", wall=3.2)]  # one long step spanning every shared one
    return window(steps={"small": alone + shared, "big": big}, models=classes or {})


def test_sharing_contention_fires_when_p99_jumps_with_a_neighbour():
    assert sharing_contention(shared_window(0.04), "small", TH) == {
        "p99_alone_ms": 10.0, "p99_shared_ms": 40.0, "ratio": 4.0, "p50_alone_ms": 10.0, "p50_shared_ms": 40.0,
        "num_steps_alone": 25, "num_steps_shared": 25, "neighbours": "big"}


def test_sharing_contention_quiet():
    assert sharing_contention(shared_window(0.012), "small", TH) is None
    classes = {"small": {"sharing_class": "best_effort"}, "big": {"sharing_class": "latency_critical"}}
    assert sharing_contention(shared_window(0.04, classes), "small", TH) is None  # not the model to protect


# ---- weight-cache rules -------------------------------------------------------------------------------

def cache(t, hits, misses):
    """status.weight_cache as weights/cache.py reports it, plus the config's alert (added by the monitor)."""
    return {"t": t, "hit_rate_alert": 0.9, "device": {"cache_size": 1, "models": ["a"]},
            "hits": {"device": hits, "host": 0}, "misses": {"device": misses, "host": 0}}


def cyclic_trace(n=40):
    return [finished(NOW - 100 + i, 5, model="abc"[i % 3]) for i in range(n)]


def test_lru_sizing():
    models = ["abc"[i % 3] for i in range(40)]
    assert lru_hit_rate(models, 2) == 0.0  # the classic LRU worst case
    assert lru_size_for(models, 0.9) == (3, 37 / 40)


def test_cache_hit_rate_low_fires_with_a_size_from_the_trace():
    w = window(weight_cache=[cache(NOW - 100, 100, 10), cache(NOW, 150, 60)], events=cyclic_trace())
    assert cache_hit_rate_low(w, None, TH) == {
        "tier": "device", "hit_rate": 0.5, "hits": 50, "misses": 50, "threshold": 0.9, "cache_size": 1,
        "suggested_cache_size": 3, "suggested_hit_rate": 0.925, "num_requests": 40, "num_models": 3}


def test_cache_hit_rate_low_quiet():
    w = window(weight_cache=[cache(NOW - 100, 100, 10), cache(NOW, 195, 15)], events=cyclic_trace())
    assert cache_hit_rate_low(w, None, TH) is None
    w = window(events=cyclic_trace())  # no weight cache in this daemon
    assert cache_hit_rate_low(w, None, TH) is None
    rule = next(r for r in ALL_RULES if r.name == "cache_hit_rate_low")
    assert "weight_cache" in missing_inputs(rule, w)[0]


def test_cache_hit_rate_low_quiet_when_the_misses_are_first_loads():
    # three models, a device tier of three: 3 misses in 26 lookups (0.885) are each model's first load,
    # which no bigger cache avoids
    sample = cache(NOW, 23, 3)
    sample["device"]["cache_size"] = 3
    w = window(weight_cache=[sample], events=cyclic_trace(26))
    assert cache_hit_rate_low(w, None, TH) is None
    sample["device"]["cache_size"] = 2  # a tier of two would miss more: raising it to 3 is the advice
    assert cache_hit_rate_low(w, None, TH)["suggested_cache_size"] == 3


def evict_then_burst(unload_reason="evicted", load_at=NOW - 80):
    kind = "model_evict" if unload_reason == "evicted" else "model_unload"  # the weight cache's event
    return ([{"type": kind, "t": NOW - 100, "model": "x", "for": "y", "reason": unload_reason}]
            + [finished(load_at + 5, 4, model="x", arrival_t=load_at - 5 + i) for i in range(5)]
            + [{"type": "model_load", "t": load_at, "model": "x", "phase": "start"}])


def test_load_after_evict_fires_on_a_burst_reload():
    events = sorted(evict_then_burst(), key=lambda e: e["t"])
    assert load_after_evict(window(events=events), None, TH) == {
        "model": "x", "evicted_s_before": 20.0, "num_requests": 5, "num_reloads": 1, "threshold_s": 60.0}


@pytest.mark.parametrize("reason,load_at", [(None, NOW - 80), ("evicted", NOW - 10)])
def test_load_after_evict_quiet(reason, load_at):
    # an operator's unload is no eviction; a reload 90 s later is not "just evicted"
    events = sorted(evict_then_burst(reason, load_at), key=lambda e: e["t"])
    assert load_after_evict(window(events=events), None, TH) is None


# ---- the monitor ---------------------------------------------------------------------------------------

def test_monitor_activates_updates_and_clears_hints():
    mon = HintMonitor()
    for s in steps(used=96, total=100, running=4, waiting=8):
        mon.observe(s)
    mon.observe({"type": "hint", "t": NOW})  # its own output is not input
    changes = mon.evaluate(NOW, models={"m": {"preemption": {"mode": "off"}}})
    names = {c["name"] for c in changes}
    assert "kv_quota_small" in names and all(c["active"] and c["type"] == "hint" for c in changes)
    hint = next(h for h in mon.hints() if h["name"] == "kv_quota_small")
    assert hint["model"] == "m" and hint["since"] == NOW and hint["evidence"]["kv_blocks_wanted"] == 288
    assert "2.88x" in hint["action"] and hint["symptom"] and hint["cause"]
    assert mon.evaluate(NOW + 1, models={"m": {}}) == []  # still on: no new event
    later = mon.evaluate(NOW + 100, models={"m": {}})  # the steps left the 30 s window
    off = [c for c in later if c["name"] == "kv_quota_small"]
    assert off and off[0]["active"] is False and off[0]["evidence"]["waiting_mean"] == 8.0
    assert not any(h["name"] == "kv_quota_small" for h in mon.hints())


def test_monitor_reports_unfed_rules_and_survives_a_broken_rule():
    mon = HintMonitor()
    fed = {r["name"]: r for r in mon.rule_status()}
    for name in ("bandwidth_bound", "device_errors", "timeslice_overhead", "cache_hit_rate_low", "load_after_evict"):
        assert not fed[name]["fed"] and fed[name]["missing"]  # until a window holds their data
    for name in ("preemption_off_skewed", "starvation", "swap_thrash", "kv_quota_small", "scheduler_overhead"):
        assert fed[name]["fed"]
    mon.rules[0].check, saved = (lambda w, m, th: 1 / 0), mon.rules[0].check
    try:
        mon.observe(step(NOW))
        mon.evaluate(NOW)  # logs the failure, runs the other rules
    finally:
        mon.rules[0].check = saved
    assert mon.num_evaluations == 1


class _CountedEvents(list):
    """An event list that counts the passes over it."""

    passes = 0

    def __iter__(self):
        self.passes += 1
        return super().__iter__()


def test_one_evaluation_passes_over_the_events_once():
    """The daemon's window holds up to 20000 events (one per arbiter time slice) and is evaluated on the event
    loop every second: the rules share one pass that sorts the events by type."""
    events = _CountedEvents(slices(0.002) + [finished(NOW - 5, 8, model="a"), finished(NOW - 4, 8, model="b")]
                            + [{"type": "model_evict", "t": NOW - 3, "model": "a"}])
    w = window(steps={"a": steps(model="a"), "b": steps(model="b")}, events=events)
    HintMonitor().evaluate(window=w)
    assert events.passes == 1
    assert w.recent_events(("model_evict", "request_finished"), 60.0) == events[-3:]  # across types, by time
    assert [e["model"] for e in w.recent_events("request_finished", 60.0, "b")] == ["b"]

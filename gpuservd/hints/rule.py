"""A hint rule (symptom -> likely cause -> action, with the evidence that fired it) and its inputs.

A rule's `check(window, model, thresholds)` returns the evidence (a dict of
numbers and names) when the symptom holds, else None. `per_model` rules are
checked once per loaded model; the others once per daemon (model None).

Every rule names the inputs it reads. An input is *fed* when the window holds
data of that kind; the daemon reports, per rule, which inputs are missing
(`/admin/status` `hint_rules`), so a rule that cannot fire on this box says so
instead of staying silently quiet. The field names each input expects are the
contract for the parts of the daemon that do not emit them yet (README,
"Hints").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from gpuservd.hints.window import Window


@dataclass
class Thresholds:
    """Every number a rule compares against; the defaults are the field's rules of thumb (e.g. preemption pays when P99/P50 of lengths > 5)."""

    step_span_s: float = 30.0  # rules over step records look this far back
    event_span_s: float = 300.0  # rules over finished requests and events look this far back
    min_steps: int = 20  # fewer steps in the window: no verdict
    # bandwidth_bound
    sm_util_low_pct: float = 50.0  # mean SM utilisation under this ...
    step_high_s: float = 0.05  # ... while the P50 step takes longer than this
    mem_bw_high_pct: float = 60.0  # and, when reported, memory-bandwidth utilisation at least this
    # preemption_off_skewed
    skew_ratio: float = 5.0  # P99/P50 of output lengths above this
    skew_min_requests: int = 20  # finished requests needed for a verdict
    skew_max_requests: int = 200  # the most recent ones only (the engine's auto_window)
    # starvation
    starvation_preemptions: int = 3  # one request preempted this often within starvation_span_s
    starvation_span_s: float = 120.0
    # swap_thrash
    thrash_span_s: float = 10.0  # swapped out again within this long after coming back in
    thrash_cycles: int = 2  # out -> in -> out counts as 1; at least this many per request (or requests)
    # cache_hit_rate_low
    hit_rate_alert: float = 0.9  # the weight cache's own `hit_rate_alert` wins when reported
    hit_rate_min_lookups: int = 20
    # load_after_evict
    evict_reload_s: float = 60.0  # a load this soon after the same model's eviction ...
    burst_span_s: float = 10.0  # ... with at least burst_min_requests for it within this span of the load
    burst_min_requests: int = 4
    # batch_past_plateau
    plateau_margin: float = 1.25  # decode batch P50 above plateau_batch * this
    # kv_quota_small
    kv_full_share: float = 0.9  # KV blocks used / total at or above this ...
    kv_full_steps_share: float = 0.5  # ... in this share of the window's steps (preemptions free blocks) ...
    kv_waiting_mean: float = 4.0  # ... while this many requests wait on average
    # timeslice_overhead: switching should cost at most ~5% of the time (measured 3-5% at a 20 ms quantum)
    timeslice_overhead_share: float = 0.05
    timeslice_min_slices: int = 20
    # sharing_contention: isolation is judged on P99, never the mean
    contention_ratio: float = 2.0  # P99 step time with a neighbour stepping / P99 alone
    # scheduler_overhead: the scheduler's own cost must stay below what it wins
    decision_share: float = 0.10  # scheduler decision time / step time above this
    # prefix_caching_off_repeats
    repeat_share: float = 0.3  # prompt tokens a prefix cache would have reused / prefill tokens, at least this
    repeat_min_tokens: int = 256  # ... and at least this many such tokens in the window


@dataclass
class Rule:
    """One troubleshooting-table row, as code."""

    name: str  # stable id (the hint's name, the metric label)
    symptom: str  # what an operator sees
    cause: str  # the likely cause
    action: str  # what to do; may use {evidence keys}
    inputs: tuple[str, ...]  # names in INPUTS this rule reads
    check: Callable[[Window, str | None, Thresholds], dict | None] = field(repr=False)
    per_model: bool = True

    def action_text(self, evidence: dict) -> str:
        try:
            return self.action.format(**evidence)
        except (KeyError, IndexError, ValueError):
            return self.action


def _has_reading(key: str) -> Callable[[Window], bool]:
    """Fed when a reading has a value: on a CPU the readings carry the key as null (with a reason)."""
    return lambda w: any(r.get(key) is not None for r in w.readings)


# input name -> (is it fed in this window?, where it must come from when it is not)
INPUTS: dict[str, tuple[Callable[[Window], bool], str]] = {
    "steps": (lambda w: True, "engine step records"),
    "request_finished": (lambda w: True, "request_finished events"),
    "preemptions": (lambda w: True, "preemption events / step records' preempted_ids"),
    "swaps": (lambda w: True, "swap events / step records' swaps"),
    "sm_util": (_has_reading("sm_util_pct"),
                "status.device.readings.sm_util_pct (NVML utilisation.gpu); null here (no CUDA device or no NVML)"),
    "device_health": (lambda w: any((r.get("xid_errors_total") is not None or r.get("health") is not None)
                                    for r in w.readings)
                      or bool(w.of_type("device_error")),
                      "status.device.readings.health / xid_errors_total or device_error events (NVML); "
                      "null here (no CUDA device or no NVML)"),
    "weight_cache": (lambda w: any(s.get("hits") is not None for s in w.weight_cache),
                     "status.weight_cache.hits / misses per tier (the weight cache)"),
    "evictions": (lambda w: any(s.get("hits") is not None for s in w.weight_cache)
                  or bool(w.of_type("model_evict"))
                  or any(_is_eviction(e) for e in w.of_type("model_unload")),
                  "model_evict events (the weight cache's LRU)"),
    "time_slices": (lambda w: bool(w.of_type("time_slice")),
                    "time_slice events (run_s, switch_s, quantum_ms) from the arbiter: two models of one group with "
                    "work at the same time (none yet, or sharing.enabled is false)"),
    "sharing": (lambda w: sum(1 for s in w.steps.values() if s) >= 2,
                "step records of two or more models on one device (load a second model)"),
    "sweep": (lambda w: bool(w.sweeps), "a `gpuserv bench sweep --model M` result for the served model"),
}


def _is_eviction(e: dict) -> bool:
    return e.get("type") == "model_evict" or (e.get("type") == "model_unload" and e.get("reason") == "evicted")


def missing_inputs(rule: Rule, window: Window) -> list[str]:
    """The sources a rule reads that the window has no data from (empty: the rule can fire)."""
    return [INPUTS[i][1] for i in rule.inputs if not INPUTS[i][0](window)]

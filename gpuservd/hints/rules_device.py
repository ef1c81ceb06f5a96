"""Rules over the device: utilisation readings, health, time slices, and models sharing one device.

Inputs: `sharing_contention` reads step records of co-resident models and their
`sharing_class` (status.models); `timeslice_overhead` reads the arbiter's
`time_slice` events (`run_s`, `switch_s`, `quantum_ms`); `bandwidth_bound`
reads `status.device.readings` (gpu/readings.py: NVML on CUDA; SM activity
from GPM where the GPU has it, else NVML's utilisation, which reads ~100% on
memory-bound decode and so rarely fires); `device_errors` reads the readings'
`health` / `xid_errors_total` or `device_error` events. On a CPU the device
readings are None with a reason, so the two reading rules report that input
as missing rather than guessing.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

from gpuservd.hints.rule import Rule, Thresholds
from gpuservd.hints.window import Window, mean, pct, r3


def bandwidth_bound(w: Window, model: str, th: Thresholds) -> dict | None:
    """SM utilisation low while steps are slow -> the SMs wait on memory."""
    def sm_of(r: dict):  # GPM's SM activity when the GPU has it: NVML's utilisation counts any kernel as busy
        return r.get("sm_active_pct") if r.get("sm_active_pct") is not None else r.get("sm_util_pct")

    readings = [r for r in w.recent_readings(th.step_span_s) if sm_of(r) is not None]
    steps = w.recent_steps(model, th.step_span_s)
    if not readings or len(steps) < th.min_steps:
        return None
    sm = mean(sm_of(r) for r in readings)
    mem_values = [r["mem_bw_util_pct"] for r in readings if r.get("mem_bw_util_pct") is not None]
    mem = mean(mem_values) if mem_values else None
    step_p50 = pct([s["wall_s"] for s in steps], 50)
    if sm >= th.sm_util_low_pct or step_p50 <= th.step_high_s or (mem is not None and mem < th.mem_bw_high_pct):
        return None
    return {"sm_util_pct": r3(sm), "mem_bw_util_pct": r3(mem) if mem is not None else None,
            "step_ms_p50": r3(1000 * step_p50), "num_steps": len(steps), "num_readings": len(readings)}


def device_errors(w: Window, model: None, th: Thresholds) -> dict | None:
    """NVML health or Xid errors: the device is failing."""
    readings = w.recent_readings(th.event_span_s)
    xids = [r["xid_errors_total"] for r in readings if r.get("xid_errors_total") is not None]
    new_xids = (xids[-1] - xids[0]) if len(xids) >= 2 else (xids[-1] if xids else 0)
    health = next((r["health"] for r in reversed(readings) if r.get("health") is not None), None)
    errors = w.recent_events("device_error", th.event_span_s)
    if new_xids <= 0 and health in (None, "ok") and not errors:
        return None
    last = errors[-1] if errors else {}
    return {"xid_errors": new_xids, "health": health, "num_error_events": len(errors),
            "last_xid": last.get("xid"), "last_error": last.get("message")}


def timeslice_overhead(w: Window, model: None, th: Thresholds) -> dict | None:
    """Switching between models that share an SM group eats more than 5% of the time.

    A switch is what the arbiter times: from the release to the moment the next holder's thread runs. On a
    CPU that is a thread wake plus taking the GIL, about 0.1 ms at the median against a quantum of at least
    10 ms (1%); it passes 5% only when the OS or another Python thread keeps the woken thread waiting, on an
    oversubscribed machine (two tiny models at a 10 ms quantum on a loaded 2-core box read 5.03%, from a
    tail of 3-17 ms waits behind a 0.08 ms median). No quantum or model setting makes that happen on
    purpose, so this rule is not fired from real records on a CPU; the 5% was set for switches between
    partitions on a GPU."""
    slices = w.recent_events("time_slice", th.step_span_s)
    if len(slices) < th.timeslice_min_slices:
        return None
    switch = sum(e["switch_s"] for e in slices)
    total = switch + sum(e["run_s"] for e in slices)
    share = switch / total if total > 0 else 0.0
    if share <= th.timeslice_overhead_share:
        return None
    return {"overhead_share": r3(share), "threshold": th.timeslice_overhead_share,
            "quantum_ms": slices[-1].get("quantum_ms"), "switch_ms_p50": r3(1000 * pct([e["switch_s"] for e in slices], 50)),
            "num_slices": len(slices)}


def _overlaps(starts: list[float], reach: list[float], a: float, b: float) -> bool:
    """Does [a, b] intersect any interval of a list sorted by start? reach[i] is the latest end among the
    first i + 1 intervals, so one bisection answers: this runs for every step in the window, once a second
    on the daemon's event loop, and a scan back over the neighbours' steps took tens of milliseconds there."""
    i = bisect_left(starts, b)  # intervals starting before b
    return i > 0 and reach[i - 1] > a


def sharing_contention(w: Window, model: str, th: Thresholds) -> dict | None:
    """A latency-critical model's P99 step time is much worse while a neighbour steps at the same time.

    On a CPU all models share one time-sliced group, so what a step pays beside a neighbour is mostly the
    neighbour's turn: a best-effort model cut between two layers waits for it inside its step. A neighbour's
    step counts once it has ended (its record); one still suspended at the evaluation is not seen yet."""
    classes = {m: (s or {}).get("sharing_class") for m, s in w.models.items()}
    if any(c == "latency_critical" for c in classes.values()) and classes.get(model) != "latency_critical":
        return None  # classes are declared and this model is not the one to protect
    mine = w.recent_steps(model, th.step_span_s)
    others = sorted((s["t"] - s["wall_s"], s["t"], m) for m in w.steps if m != model
                    for s in w.recent_steps(m, th.step_span_s))
    if len(mine) < th.min_steps or not others:
        return None
    starts, reach = [o[0] for o in others], list(accumulate((o[1] for o in others), max))
    shared, alone = [], []
    for s in mine:
        (shared if _overlaps(starts, reach, s["t"] - s["wall_s"], s["t"]) else alone).append(s["wall_s"])
    if len(shared) < th.min_steps or len(alone) < th.min_steps:
        return None
    p99_shared, p99_alone = pct(shared, 99), pct(alone, 99)
    ratio = p99_shared / p99_alone if p99_alone > 0 else 0.0
    if ratio < th.contention_ratio:
        return None
    return {"p99_alone_ms": r3(1000 * p99_alone), "p99_shared_ms": r3(1000 * p99_shared), "ratio": r3(ratio),
            "p50_alone_ms": r3(1000 * pct(alone, 50)), "p50_shared_ms": r3(1000 * pct(shared, 50)),
            "num_steps_alone": len(alone), "num_steps_shared": len(shared),
            "neighbours": ",".join(sorted({o[2] for o in others}))}


RULES = [
    Rule("bandwidth_bound", "low SM utilisation but high step latency",
         "memory-bandwidth bound: the SMs wait on HBM (adding GPUs will not help)",
         "quantise harder (fewer weight bytes per step) or change the batch mix (larger decode batches share "
         "each weight read); SM {sm_util_pct}%, step P50 {step_ms_p50} ms",
         ("sm_util", "steps"), bandwidth_bound),
    Rule("device_errors", "device errors (NVML health, Xid)",
         "the GPU is failing or was reset", "drain the device (gpuserv drain), check nvidia-smi -q and dmesg "
         "for Xid {last_xid}, restart once it is healthy", ("device_health",), device_errors, per_model=False),
    Rule("timeslice_overhead", "time-slice switching overhead above 5%",
         "the quantum is too short for the models sharing an SM group",
         "raise the arbiter's quantum_ms (now {quantum_ms}, allowed 10-50); switching takes {overhead_share}",
         ("time_slices",), timeslice_overhead, per_model=False),
    Rule("sharing_contention", "a latency-critical model's P99 is unstable under sharing",
         "bandwidth contention with the models that step at the same time",
         "raise this model's class to latency_critical or throttle the neighbour ({neighbours}); "
         "P99 step {p99_shared_ms} ms shared vs {p99_alone_ms} ms alone",
         ("sharing", "steps"), sharing_contention),
]

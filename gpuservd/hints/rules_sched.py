"""Rules over the scheduler's own telemetry: step records, finished requests, preemptions, swaps.

All of their inputs exist in this daemon (the engine and serving layers emit them).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from gpuservd.hints.rule import Rule, Thresholds
from gpuservd.hints.window import Window, mean, pct, r3


def _preemption(w: Window, model: str) -> dict:
    return (w.models.get(model) or {}).get("preemption") or {}


def preemption_off_skewed(w: Window, model: str, th: Thresholds) -> dict | None:
    """Output lengths are skewed (P99/P50 > 5) and preemption is off."""
    done = [e for e in w.recent_events("request_finished", th.event_span_s, model)
            if e.get("status", 200) == 200 and (e.get("num_output_tokens") or 0) >= 1]
    done = done[-th.skew_max_requests:]
    if len(done) < th.skew_min_requests:
        return None
    steps = w.recent_steps(model, th.step_span_s)
    p = _preemption(w, model)
    if p.get("enabled") or any(s.get("preemption_on") for s in steps):
        return None
    lengths = [max(1, int(e["num_output_tokens"])) for e in done]
    p50, p99 = pct(lengths, 50), pct(lengths, 99)
    ratio = p99 / p50
    if ratio <= th.skew_ratio:
        return None
    return {"output_p50": p50, "output_p99": p99, "ratio": r3(ratio), "threshold": th.skew_ratio,
            "num_requests": len(done), "mode": p.get("mode", "unknown")}


def starvation(w: Window, model: str, th: Thresholds) -> dict | None:
    """One request preempted again and again."""
    counts: Counter = Counter()
    for e in w.recent_events("preemption", th.starvation_span_s, model):
        counts.update(e.get("request_ids") or [v.get("request_id") for v in e.get("victims") or []])
    starved = {rid: n for rid, n in counts.items() if n >= th.starvation_preemptions}
    if not starved:
        return None
    worst, n = max(starved.items(), key=lambda kv: (kv[1], kv[0]))
    return {"request_id": worst, "num_preemptions": n, "num_starved": len(starved),
            "threshold": th.starvation_preemptions, "span_s": th.starvation_span_s,
            "victim_policy": _preemption(w, model).get("victim_policy", "unknown")}


def swap_thrash(w: Window, model: str, th: Thresholds) -> dict | None:
    """The same request's KV swapped in and out again within thrash_span_s."""
    swaps = w.recent_events("swap", th.event_span_s, model)
    by_request: dict[str, list[dict]] = defaultdict(list)
    for e in swaps:
        by_request[e.get("request_id")].append(e)
    cycles: dict[str, int] = {}
    for rid, moves in by_request.items():
        last_in = None
        for m in moves:
            if m.get("kind") == "swap_in":
                last_in = m["t"]
            elif m.get("kind") == "swap_out" and last_in is not None and m["t"] - last_in <= th.thrash_span_s:
                cycles[rid] = cycles.get(rid, 0) + 1
                last_in = None
    total = sum(cycles.values())
    if total < th.thrash_cycles:
        return None
    steps = w.recent_steps(model, th.event_span_s)
    wall = sum(s["wall_s"] for s in steps)
    worst = max(cycles.items(), key=lambda kv: (kv[1], kv[0]))
    return {"num_cycles": total, "num_requests": len(cycles), "worst_request": worst[0], "worst_cycles": worst[1],
            "bytes_moved": sum(int(e.get("bytes_moved") or 0) for e in swaps),
            "swap_share": r3(sum(s.get("swap_s", 0.0) for s in steps) / wall) if wall > 0 else None,
            "memory_threshold": _preemption(w, model).get("memory_threshold")}


def kv_quota_small(w: Window, model: str, th: Thresholds) -> dict | None:
    """KV blocks (nearly) all used while a queue waits: the model's KV budget is too small for the traffic."""
    steps = [s for s in w.recent_steps(model, th.step_span_s) if s.get("kv_blocks_total")]
    if len(steps) < th.min_steps:
        return None
    # Blocks promised to requests that may not be preempted again are as good as used for admission.
    use = [(s["kv_blocks_used"] + s.get("kv_blocks_reserved", 0)) / s["kv_blocks_total"] for s in steps]
    full = [s for s, u in zip(steps, use) if u >= th.kv_full_share]
    full_share = len(full) / len(steps)
    waiting = mean(s["num_waiting"] for s in steps)
    if full_share < th.kv_full_steps_share or waiting < th.kv_waiting_mean:
        return None
    total = steps[-1]["kv_blocks_total"]
    # What the traffic would hold at once: blocks per running request times running + waiting.
    per_seq = mean(s["kv_blocks_used"] / max(1, s["num_running"]) for s in full)
    want = per_seq * mean(s["num_running"] + s["num_waiting"] for s in full)
    return {"kv_use_p50": r3(pct(use, 50)), "full_steps_share": r3(full_share), "waiting_mean": r3(waiting),
            "waiting_max": max(s["num_waiting"] for s in steps), "kv_blocks_total": total,
            "kv_blocks_wanted": int(round(want)), "scale": r3(want / total), "num_steps": len(steps)}


def scheduler_overhead(w: Window, model: str, th: Thresholds) -> dict | None:
    """The scheduler's decision takes a large share of each step: the median step's share, so that one
    decision the OS descheduled (tens of ms on a busy machine) does not make a healthy window fire."""
    steps = w.recent_steps(model, th.step_span_s)
    if len(steps) < th.min_steps:
        return None
    share = pct([s["decision_s"] / s["wall_s"] if s["wall_s"] > 0 else 0.0 for s in steps], 50)
    if share <= th.decision_share:
        return None
    return {"decision_share": r3(share), "threshold": th.decision_share,
            "decision_ms_p50": r3(1000 * pct([s["decision_s"] for s in steps], 50)),
            "step_ms_p50": r3(1000 * pct([s["wall_s"] for s in steps], 50)), "num_steps": len(steps),
            "waiting_mean": r3(mean(s["num_waiting"] for s in steps))}


def prefix_caching_off_repeats(w: Window, model: str, th: Thresholds) -> dict | None:
    """Prefix caching is off while admitted prompts repeat prefixes of recent ones (the step records'
    repeat tokens: what a cache would have reused), so the same tokens are prefilled again and again."""
    steps = w.recent_steps(model, th.step_span_s)
    if not steps or any(s.get("prefix_caching") for s in steps):
        return None
    repeated = sum(s.get("num_prefix_repeat_tokens", 0) for s in steps)
    prefill = sum(s["num_prefill_tokens"] for s in steps)
    if repeated < th.repeat_min_tokens or not prefill or repeated / prefill < th.repeat_share:
        return None
    return {"repeat_tokens": repeated, "prefill_tokens": prefill, "repeat_share": r3(repeated / prefill),
            "threshold": th.repeat_share, "num_steps": len(steps)}


def batch_past_plateau(w: Window, model: str, th: Thresholds) -> dict | None:
    """The decode batch runs past the size where the sweep found throughput stops growing."""
    sweep = w.sweeps.get(model)
    if not sweep or not sweep.get("plateau_batch"):
        return None
    decode = [s["num_decode_tokens"] for s in w.recent_steps(model, th.step_span_s) if s["num_decode_tokens"]]
    if len(decode) < th.min_steps:
        return None
    plateau = int(sweep["plateau_batch"])
    batch = pct(decode, 50)
    if batch <= plateau * th.plateau_margin:
        return None
    points = sweep.get("points") or []

    def tokens_s(b: float):
        below = [p for p in points if p["batch"] <= b]
        return r3(below[-1]["tokens_s"]) if below else None

    rec = sweep.get("recommended") or {}
    return {"decode_batch_p50": batch, "plateau_batch": plateau,
            "max_num_seqs": (w.models.get(model) or {}).get("max_num_seqs"),
            "tokens_s_at_plateau": tokens_s(plateau), "tokens_s_at_batch": tokens_s(batch),
            "recommended_decode_heavy": rec.get("decode_heavy"), "recommended_prefill_heavy": rec.get("prefill_heavy"),
            "sweep": sweep.get("path", "")}


RULES = [
    Rule("preemption_off_skewed", "output lengths are skewed (P99/P50 > 5) and preemption is off",
         "long requests hold the batch while short ones queue behind them",
         "set preemption.mode to auto or on: P99/P50 of output lengths is {ratio} (> {threshold})",
         ("request_finished", "steps"), preemption_off_skewed),
    Rule("starvation", "a request is preempted again and again",
         "the victim policy keeps choosing the same request (most-remaining starves long requests)",
         "switch preemption.victim_policy to progress or weighted, or raise preemption.min_exec_s "
         "({request_id} preempted {num_preemptions} times; policy {victim_policy})",
         ("preemptions",), starvation),
    Rule("swap_thrash", "the same requests' KV is swapped out again soon after coming back",
         "device KV memory is too tight for the running set, so swapped requests bounce",
         "raise engine.kv_cache_bytes or preemption.memory_threshold (now {memory_threshold}), "
         "or raise preemption.min_exec_s; {num_cycles} out-in-out cycles, {bytes_moved} bytes moved",
         ("swaps", "steps"), swap_thrash),
    Rule("kv_quota_small", "KV cache nearly full with a long waiting queue",
         "the model's KV memory quota is too small for the traffic",
         "raise engine.kv_cache_bytes about {scale}x (to ~{kv_blocks_wanted} blocks from {kv_blocks_total}), "
         "or limit admission (server.max_queued_per_model, tenant max_kv_blocks)",
         ("steps",), kv_quota_small),
    Rule("scheduler_overhead", "scheduler decision time is a large share of step time",
         "the per-step decision (queue ordering, victim choice) costs more than it wins",
         "shorten the waiting queue (server.max_queued_per_model), use victim_policy newest or granularity "
         "request; decisions take {decision_share} of step time",
         ("steps",), scheduler_overhead),
    Rule("prefix_caching_off_repeats", "prompts repeat the same prefixes while prefix caching is off",
         "every request prefills a shared system prompt or conversation history from scratch",
         "set engine.prefix_caching: true; {repeat_tokens} of {prefill_tokens} prefill tokens "
         "({repeat_share}) repeated a recent prompt's prefix",
         ("steps",), prefix_caching_off_repeats),
    Rule("batch_past_plateau", "the decode batch runs past the throughput plateau",
         "past the plateau a bigger batch adds latency to every request without adding throughput",
         "lower scheduler.max_num_seqs to {recommended_decode_heavy} (decode-heavy) or "
         "{recommended_prefill_heavy} (prefill-heavy); plateau at batch {plateau_batch}",
         ("steps", "sweep"), batch_past_plateau),
]

"""Dashboard: per-step latency per model (P50 / P99 over the window, a chart), tokens/s, queues, KV, and the side panels."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Container

from console.screens import ConsoleScreen
from console.state import LATENCY_WINDOW, RATE_WINDOW_S
from console.widgets import NOT_REPORTED, UNAVAILABLE, Panel, bar_chart, fmt_bytes, fmt_ms, fmt_utc, gauge, victim_cost

MAX_CHART_ROWS = 12


def latency_text(views, width: int, height: int, connected: bool = True) -> Text:
    if not views:
        return Text("no model loaded" if connected else "no data from the daemon yet")
    out = Text()
    per_model = max(4, height // len(views))
    for i, v in enumerate(views):
        if i:
            out.append("\n")
        out.append(f"{v.name}", style="bold")
        out.append(f"  P50 {fmt_ms(v.p50_ms)} ms  P99 {fmt_ms(v.p99_ms)} ms  last {fmt_ms(v.last_ms)} ms  "
                   f"{v.tokens_per_s:.0f} tok/s\n")
        if v.part_p50_ms:
            out.append("P50 parts: " + " + ".join(f"{k} {fmt_ms(ms)}" for k, ms in v.part_p50_ms.items()) + " ms\n")
        queues = "-" if v.num_running is None else f"{v.num_running} running, {v.num_waiting} waiting"
        out.append(f"queue {queues}  KV {gauge(v.kv_used, v.kv_total, 16)}\n")
        used = 3 + bool(v.part_p50_ms)
        chart_h = min(MAX_CHART_ROWS, per_model - used)
        out.append_text(chart(v.latency_ms, width, chart_h, "ms", "step wall time"))
        left = per_model - used - chart_h - 1
        if left >= 5:  # room for the batch: tokens per step (prefill chunks + decodes)
            out.append("\n")
            out.append_text(chart(v.tokens_per_step, width, min(8, left - 2), "tok", "tokens per step"))
    return out


def chart(values: list[float], width: int, height: int, unit: str, caption: str) -> Text:
    top = max(values, default=None)
    label = f" {fmt_ms(top) if unit == 'ms' else top or 0} {unit}"
    chart_w = width - len(label) - 1
    out = Text()
    for j, row in enumerate(bar_chart(values, chart_w, height - 1)):
        out.append(row + (label if j == 0 else "") + "\n")
    out.append(f"{caption}, newest {min(len(values), chart_w)} of {len(values)} steps", style="dim")
    return out


def preemption_text(state, n: int, width: int) -> Text:
    recent = state.recent_preemptions(n)
    if not recent:
        return Text("none seen")
    wide = width >= 50
    out = Text()
    for e in recent:
        victims = e.get("victims") or [{"request_id": i} for i in e.get("request_ids") or []] or [e]
        who = ", ".join(f"{(v.get('request_id') or v.get('victim') or '?')[:None if wide else 13]}"
                        + (f" {victim_cost(v)}" if victim_cost(v) else "") for v in victims)
        step = f" step {e.get('step_id')}" if wide else ""
        out.append(f"{fmt_utc(e.get('t'))} {e.get('model', '')}{step} {who}\n")
    return out


def swap_text(state) -> str:
    lines = []
    rates = state.swap_rates()
    if rates is None:
        lines.append(f"swap: {NOT_REPORTED}")
    else:
        lines.append(f"out {fmt_bytes(rates['out'])}/s  in {fmt_bytes(rates['in'])}/s (last {RATE_WINDOW_S:.0f} s)")
    for m in (state.status or {}).get("models", []):
        p = m.get("preemption")
        if p:
            lines.append(f"{m['name']}: {p.get('mode')} {p.get('granularity', '')} {p.get('kind', '')}, "
                         f"host {p.get('host_blocks_used', 0)}/{p.get('host_blocks_total', 0)} blocks, "
                         f"{p.get('num_swapped', 0)} swapped")
        lines.extend(prefix_cache_lines(m))
    return "\n".join(lines)


def prefix_cache_lines(m: dict) -> list[str]:
    """`smollm2: prefix cache 83% hit (1.0k of 1.2k tokens), 40 blocks`, or `off` when disabled."""
    pc = m.get("prefix_cache")
    if not pc:
        return []
    if not pc.get("enabled"):
        return [f"{m['name']}: prefix cache off"]
    q, h = pc.get("query_tokens", 0), pc.get("hit_tokens", 0)
    rate = f"{100 * h / q:.0f}%" if q else "-"
    return [f"{m['name']}: prefix cache {rate} hit ({h} of {q} tokens), {pc.get('cached_blocks', 0)} blocks"]


# The device fields the Device panel shows (gpuservd/gpu/readings.py DEVICE_FIELDS, the ones worth a glance).
SHOWN_DEVICE_FIELDS = ("sm_util_pct", "sm_active_pct", "mem_bw_util_pct", "mem_used_bytes", "mem_total_bytes",
                       "temperature_c", "power_w", "health", "xid_errors_total")


def _pct(v) -> str:
    return f"{v:.0f}%"


def used_of_total(used, total) -> str:
    """`60.1/139.7 GiB`: both in the total's unit."""
    if used is None or not total:
        return f"{fmt_bytes(used)}/{fmt_bytes(total)}"
    unit, scale = "B", 1
    for u in ("KiB", "MiB", "GiB", "TiB"):
        if total / (scale * 1024) < 1:
            break
        unit, scale = u, scale * 1024
    return f"{used / scale:.1f}/{total / scale:.1f} {unit}"


def readings_lines(r: dict, width: int = 36) -> list[str]:
    """The device part of a reading (only what has a value), packed into lines of `width`, or why there is none.

    Utilisation and memory first, then health and Xids (so a narrow panel's three lines still show them),
    then throttling, temperature and power."""
    if all(r.get(k) is None for k in SHOWN_DEVICE_FIELDS):
        why = r.get("unavailable") or {}
        reasons = [why[k] for k in SHOWN_DEVICE_FIELDS if why.get(k)] or list(why.values())
        return [f"device readings unavailable: {reasons[0] if reasons else 'no reason given'}"]
    parts = []
    if r.get("sm_util_pct") is not None:
        sm = f"SM {_pct(r['sm_util_pct'])}"
        if r.get("sm_active_pct") is not None:
            sm += f" (active {_pct(r['sm_active_pct'])})"
        parts.append(sm)
    elif r.get("sm_active_pct") is not None:
        parts.append(f"SM active {_pct(r['sm_active_pct'])}")
    if r.get("mem_bw_util_pct") is not None:
        parts.append(f"mem BW {_pct(r['mem_bw_util_pct'])}")
    if r.get("mem_used_bytes") is not None or r.get("mem_total_bytes") is not None:
        parts.append(f"mem {used_of_total(r.get('mem_used_bytes'), r.get('mem_total_bytes'))}")
    if r.get("health") is not None:
        health = f"health {r['health']}"
        if r["health"] != "ok" and r.get("health_reasons"):
            health += f" ({', '.join(map(str, r['health_reasons']))})"
        parts.append(health)
    if r.get("xid_errors_total") is not None:
        xid = f"Xid {r['xid_errors_total']}"
        if r.get("last_xid") is not None:
            xid += f" (last {r['last_xid']})"
        parts.append(xid)
    if r.get("throttle_reasons"):
        parts.append(f"throttled: {', '.join(map(str, r['throttle_reasons']))}")
    if r.get("temperature_c") is not None:
        parts.append(f"{r['temperature_c']:.0f}°C")
    if r.get("power_w") is not None:
        parts.append(f"{r['power_w']:.0f} W")
    lines = [parts[0]]
    for p in parts[1:]:  # a field is never split across lines
        if len(lines[-1]) + 2 + len(p) <= width:
            lines[-1] += "  " + p
        else:
            lines.append(p)
    return lines


def host_line(r: dict) -> str | None:
    parts = []
    if r.get("cpu_util_pct") is not None:
        parts.append(f"CPU {_pct(r['cpu_util_pct'])}")
    if r.get("process_rss_bytes") is not None:
        parts.append(f"RSS {fmt_bytes(r['process_rss_bytes'])}")
    return "  ".join(parts) or None


def device_text(state, width: int = 36) -> str:
    dev = (state.status or {}).get("device") or {}
    if not dev:
        return f"device: {NOT_REPORTED}"
    name = f"{dev.get('backend', '?')}: {dev.get('name', '?')}"
    if dev.get("available") is False:
        return f"{name}\n{UNAVAILABLE}"
    readings = state.device_readings()
    if readings is None:
        return f"{name}\nreadings {UNAVAILABLE} (not reported by this daemon)"
    lines = [name] + readings_lines(readings, width)
    host = host_line(readings)
    if host and len(name) + 2 + len(host) <= width:
        lines[0] = f"{name}  {host}"  # a narrow panel has three lines: keep the host beside the name
    elif host:
        lines.append(f"host {host}")
    return "\n".join(lines)


def hints_text(state) -> str:
    hints = state.hints()
    if hints is None:
        return f"hints: {NOT_REPORTED}"
    if not hints:
        return "no active hints"
    lines = []
    for h in hints:
        lines.append(f"! {h.get('symptom') or h.get('name')}: {h.get('action') or h.get('cause') or ''}")
        if h.get("evidence"):
            lines.append(f"  evidence: {h['evidence']}")
    return "\n".join(lines)


class DashboardScreen(ConsoleScreen):
    NAME = "dashboard"

    def body(self) -> ComposeResult:
        with Container(id="dash"):
            yield Panel(f"Step latency (window {LATENCY_WINDOW} steps)", id="latency")
            with Container(id="side"):
                yield Panel("Preemptions", id="preempt")
                yield Panel("Swap", id="swap")
                yield Panel("Device", id="device")
                yield Panel("Hints", id="hints")

    def draw(self, state) -> None:
        lat = self.query_one("#latency", Panel)
        size = lat.content_size
        lat.show(latency_text(state.model_views(), size.width or 76, size.height or 9, state.status is not None))
        pre = self.query_one("#preempt", Panel)
        pre.border_title = f"Preemptions ({len(state.log('preemption'))})"
        pre.show(preemption_text(state, max(1, pre.content_size.height or 3), pre.content_size.width or 36))
        self.query_one("#swap", Panel).show(swap_text(state))
        dev = self.query_one("#device", Panel)
        dev.show(device_text(state, dev.content_size.width or 36))
        self.query_one("#hints", Panel).show(hints_text(state))

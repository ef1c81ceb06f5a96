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
    return "\n".join(lines)


def device_text(state) -> str:
    dev = (state.status or {}).get("device") or {}
    if not dev:
        return f"device: {NOT_REPORTED}"
    name = f"{dev.get('backend', '?')}: {dev.get('name', '?')}"
    if dev.get("available") is False:
        return f"{name}\n{UNAVAILABLE}"
    readings = state.device_readings()
    if readings is None:
        return f"{name}\nreadings {UNAVAILABLE} (not reported by this daemon)"
    return name + "\n" + "  ".join(f"{k} {v}" for k, v in readings.items())


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
        self.query_one("#device", Panel).show(device_text(state))
        self.query_one("#hints", Panel).show(hints_text(state))

"""Events: a scrolling log of preemptions, swaps, loads, evictions, hint changes; filter by kind."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Static

from console.screens import ConsoleScreen
from console.widgets import fmt_bytes, fmt_utc, victim_cost

SKIP = ("type", "t", "model", "derived")


def describe(e: dict) -> str:
    """One line for an event: the fields an operator reads first, then the rest as key=value."""
    kind = e.get("type")
    parts = []
    if kind == "preemption":
        victims = e.get("victims") or [{"request_id": i} for i in e.get("request_ids") or []]
        parts.append(f"step {e.get('step_id', '?')}: {e.get('num_preempted', len(victims))} preempted: "
                     + "; ".join(f"{v.get('request_id')} {victim_cost(v)}".rstrip() + (
                         f" ({v['reason']})" if v.get("reason") else "") for v in victims))
        if e.get("derived"):
            parts.append("(from the step record)")
        rest = {k: v for k, v in e.items()
                if k not in SKIP + ("step_id", "num_preempted", "request_ids", "victims")}
    elif kind == "console":
        return e.get("message", "")
    elif kind == "request_finished":
        parts.append(f"{e.get('request_id')} {e.get('status')} {e.get('finish_reason')} "
                     f"{e.get('num_prompt_tokens')}+{e.get('num_output_tokens')} tokens")
        rest = {k: e.get(k) for k in ("ttft_s", "e2e_s", "tenant") if e.get(k) is not None}
    else:
        rest = {k: v for k, v in e.items() if k not in SKIP}
    for k, v in rest.items():
        if k == "bytes" and isinstance(v, (int, float)):
            v = fmt_bytes(v)
        elif (k == "seconds" or k.endswith("_s")) and isinstance(v, (int, float)):
            v = f"{v * 1000:.1f}ms"
        parts.append(f"{k}={v}")
    return " ".join(parts)


class EventsScreen(ConsoleScreen):
    NAME = "events"
    BINDINGS = [Binding("f", "next_kind", "Kind filter"), Binding("end", "follow", "Newest")]

    def __init__(self):
        super().__init__()
        self.kind: str | None = None  # None = every kind
        self._drawn = (-1, -1, None)  # (num_logged, num_log_edits, kind) last drawn
        self._rows: list[dict] = []  # the events in the table, in its order

    def body(self) -> ComposeResult:
        yield Static("", id="events-filter", markup=False)
        yield DataTable(id="events", cursor_type="row", zebra_stripes=True)
        yield Static("", id="event-detail", markup=False)

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for label in ("time UTC", "kind", "model", "details"):
            table.add_column(label, key=label)
        table.focus()

    def draw(self, state) -> None:
        kinds = state.log_kinds()
        self.query_one("#events-filter", Static).update(Text(
            f"kind: {self.kind or 'all'} ({len(state.log(self.kind))} events)  f: next of all, "
            f"{', '.join(kinds) or 'none yet'}", no_wrap=True, overflow="ellipsis"))
        table = self.query_one(DataTable)
        num, edits, kind = self._drawn
        if (num, edits, kind) == (state.num_logged, state.num_log_edits, self.kind):
            return
        following = table.row_count == 0 or table.cursor_row >= table.row_count - 1
        if edits != state.num_log_edits or kind != self.kind:
            table.clear()
            self._rows = []
            new = state.log(self.kind)
        else:
            new = [e for e in state.log_since(num) if self._matches(e)]
        for e in new:
            table.add_row(fmt_utc(e.get("t")), str(e.get("type")), str(e.get("model") or ""), Text(describe(e)))
            self._rows.append(e)
        self._drawn = (state.num_logged, state.num_log_edits, self.kind)
        if following and table.row_count:
            table.move_cursor(row=table.row_count - 1)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        row = event.cursor_row
        e = self._rows[row] if 0 <= row < len(self._rows) else None
        self.query_one("#event-detail", Static).update(
            "" if e is None else f"{fmt_utc(e.get('t'))} {e.get('type')} {e.get('model') or ''}: {describe(e)}")

    def _matches(self, e: dict) -> bool:
        if self.kind is None:
            return True
        return e.get("type") in (("swap", "swap_in", "swap_out") if self.kind == "swap" else (self.kind,))

    def action_next_kind(self) -> None:
        choices = [None] + self.app.state.log_kinds()
        self.kind = choices[(choices.index(self.kind) + 1) % len(choices)] if self.kind in choices else None
        self.redraw()

    def action_follow(self) -> None:
        table = self.query_one(DataTable)
        if table.row_count:
            table.move_cursor(row=table.row_count - 1)

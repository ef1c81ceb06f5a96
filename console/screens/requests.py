"""Requests: the daemon's unfinished requests, sortable and filterable; cancel one after a confirmation."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Input, Static

from console.screens import ConsoleScreen
from console.screens.dialogs import ConfirmScreen
from console.widgets import NOT_REPORTED, fmt_age

# (column label, row field, sort key); "waited" shows only when the daemon reports it.
COLUMNS = [
    ("id", "request_id", None), ("model", "model", None), ("tenant", "tenant", None), ("pri", "priority", 0),
    ("state", "state", None), ("prompt", "num_prompt_tokens", 0), ("gen", "num_output_tokens", 0),
    ("age", "age_s", 0.0), ("waited", "waited_s", 0.0), ("pre", "num_preemptions", 0),
]
SORTS = ["age_s", "num_output_tokens", "num_preemptions", "state", "model", "tenant", "priority", "request_id"]


def filter_rows(rows: list[dict], text: str) -> list[dict]:
    """Rows where every word of `text` is in some field (id, model, tenant, state)."""
    words = text.lower().split()
    fields = ("request_id", "model", "tenant", "state")
    return [r for r in rows if all(any(w in str(r.get(f, "")).lower() for f in fields) for w in words)]


def sort_rows(rows: list[dict], key: str, reverse: bool) -> list[dict]:
    default = next((d for _, f, d in COLUMNS if f == key), None)
    default = "" if default is None else default  # a missing value sorts as 0 (numbers) or "" (text)
    return sorted(rows, key=lambda r: default if r.get(key) is None else r[key], reverse=reverse)


class RequestsScreen(ConsoleScreen):
    NAME = "requests"
    BINDINGS = [
        Binding("c", "cancel", "Cancel"),
        Binding("slash", "filter", "Filter"),
        Binding("s", "sort", "Sort"),
        Binding("S", "reverse", "Reverse"),
        Binding("escape", "leave_filter", "Table", show=False),
    ]

    def __init__(self):
        super().__init__()
        self.sort_key = "age_s"
        self.reverse = True
        self._shown: list[dict] = []

    def body(self) -> ComposeResult:
        yield Input(placeholder="filter: words to match in id, model, tenant, state (/ to edit, Esc to leave)",
                    id="filter")
        yield DataTable(id="requests", cursor_type="row", zebra_stripes=True)
        yield Static("", id="request-detail", markup=False)

    def on_mount(self) -> None:
        self.query_one(DataTable).focus()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.redraw()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.query_one(DataTable).focus()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._detail()

    def draw(self, state) -> None:
        table = self.query_one(DataTable)
        current = self.selected()  # keep the cursor on the same request across redraws
        rows = state.requests or []
        waited = any("waited_s" in r for r in rows)
        columns = [c for c in COLUMNS if c[1] != "waited_s" or waited]
        labels = [(label + (" v" if f == self.sort_key and self.reverse else " ^" if f == self.sort_key else ""))
                  for label, f, _ in columns]
        shown = sort_rows(filter_rows(rows, self.query_one("#filter", Input).value), self.sort_key, self.reverse)
        if [str(c.label) for c in table.columns.values()] != labels:
            table.clear(columns=True)
            for label, (_, f, _) in zip(labels, columns):
                table.add_column(label, key=f)
        elif shown == self._shown:
            self._detail()
            return
        table.clear()
        for r in shown:
            cells = []
            for _, f, _ in columns:
                v = r.get(f)
                if f == "request_id":
                    v = v if len(v) <= 14 else v[:13] + "…"
                elif f in ("age_s", "waited_s"):
                    v = fmt_age(v)
                cells.append(Text("-" if v is None else str(v)))
            table.add_row(*cells, key=r["request_id"])
        self._shown = shown
        if current is not None and any(r["request_id"] == current["request_id"] for r in shown):
            table.move_cursor(row=table.get_row_index(current["request_id"]))
        self._detail()

    def _detail(self) -> None:
        rows = self.app.state.requests
        r = self.selected()
        if rows is None:
            text = "waiting for the daemon's request list"
        elif r is None:
            text = f"{len(rows)} requests in flight" + (" (none match the filter)" if rows else "")
        else:
            text = (f"{r['request_id']}  model {r.get('model')}  tenant {r.get('tenant')} (uid {r.get('uid')})\n"
                    f"{r.get('state')}: {r.get('num_prompt_tokens')} prompt + {r.get('num_output_tokens')} generated "
                    f"tokens, preempted {r.get('num_preemptions', 0)}x, age {fmt_age(r.get('age_s'))}")
            if r.get("sampling"):
                text += f"\nsampling: {r['sampling']}"
        if rows is not None and not any("waited_s" in x for x in rows):
            text += f"\nqueue wait per request: {NOT_REPORTED}"
        self.query_one("#request-detail", Static).update(text)

    def selected(self) -> dict | None:
        table = self.query_one(DataTable)
        if not self._shown or table.cursor_row is None or table.cursor_row >= len(self._shown):
            return None
        return self._shown[table.cursor_row]

    def action_filter(self) -> None:
        self.query_one("#filter", Input).focus()

    def action_leave_filter(self) -> None:
        self.query_one(DataTable).focus()

    def action_sort(self) -> None:
        self.sort_key = SORTS[(SORTS.index(self.sort_key) + 1) % len(SORTS)]
        self.redraw()

    def action_reverse(self) -> None:
        self.reverse = not self.reverse
        self.redraw()

    def action_cancel(self) -> None:
        r = self.selected()
        if r is None:
            self.notify("no request selected")
            return
        rid = r["request_id"]

        def done(yes: bool | None) -> None:
            if yes:
                self.app.act(f"cancelled {rid}", self.app.feed.cancel, rid)

        self.app.push_screen(ConfirmScreen(f"Cancel request {rid}?\n{r.get('model')}, tenant {r.get('tenant')}, "
                                           f"{r.get('num_output_tokens')} tokens generated so far."), done)

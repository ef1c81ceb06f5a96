"""Partitions: SM groups, memory quotas and arbiter shares, as far as the daemon reports them."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll

from console.screens import ConsoleScreen
from console.widgets import NOT_REPORTED, Panel


def table_of(rows: list[dict]) -> Table:
    """Any list of flat dicts as a table (the columns are the keys, in first-seen order)."""
    keys: list[str] = []
    for r in rows:
        keys.extend(k for k in r if k not in keys)
    t = Table(box=None, pad_edge=False)
    for k in keys:
        t.add_column(k)
    for r in rows:
        t.add_row(*(Text("-" if r.get(k) is None else str(r.get(k))) for k in keys))
    return t


def section(status: dict, key: str):
    value = status.get(key)
    if not value:
        return f"{key}: {NOT_REPORTED}"
    if isinstance(value, dict):
        value = [{"name": k, **v} if isinstance(v, dict) else {"name": k, "value": v} for k, v in value.items()]
    return table_of(value)


class PartitionsScreen(ConsoleScreen):
    NAME = "partitions"

    def body(self) -> ComposeResult:
        with VerticalScroll(id="parts"):
            yield Panel("SM partitions", id="sm")
            yield Panel("Memory quotas", id="quotas")
            yield Panel("Arbiter (time slices, bandwidth)", id="arbiter")

    def draw(self, state) -> None:
        status = state.status or {}
        dev = status.get("device") or {}
        sm = section(status, "partitions")
        if isinstance(sm, str) and dev.get("num_sms"):
            sm += f"\n{dev.get('name')}: {dev['num_sms']} SMs in one group"
        elif isinstance(sm, str) and dev.get("backend") == "cpu":
            sm += "\n(device is a CPU: SM partitions do not apply)"
        self.query_one("#sm", Panel).show(sm)
        self.query_one("#quotas", Panel).show(section(status, "quotas"))
        self.query_one("#arbiter", Panel).show(section(status, "arbiter"))

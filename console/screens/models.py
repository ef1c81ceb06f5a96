"""Models: what is loaded, with its weight-cache residency; load / unload / pin after a confirmation."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable

from console.screens import ConsoleScreen
from console.screens.dialogs import ConfirmScreen, PromptScreen
from console.widgets import NOT_REPORTED, Panel, fmt_bytes

COLUMNS = ["model", "state", "pinned", "device", "KV blocks", "run", "wait", "in flight", "steps", "context"]


def load_progress(state, name: str, m: dict | None = None) -> str:
    """From the model's latest model_load event: its phase, and its layers when the daemon reports them."""
    events = [e for e in state.log("model_load") if e.get("model") == name]
    if not events:
        return "no load seen since the console connected"
    e = events[-1]
    text = f"last load: {e.get('phase')}"
    if e.get("load_s") is not None:
        text += f" in {e['load_s']:.2f} s"
    if e.get("tier"):
        text += f" from the {e['tier']} tier"
    if e.get("layers_loaded") is not None and e.get("num_layers"):
        text += f", layer {e['layers_loaded']}/{e['num_layers']}"
    elif m and m.get("num_layers"):
        text += f", layers {m.get('layers_ready', 0)}/{m['num_layers']} on the device"
    elif e.get("phase") == "start":
        text += f" (layer-by-layer progress {NOT_REPORTED})"
    if e.get("error"):
        text += f": {e['error']}"
    return text


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def cache_summary(cache: dict) -> list[str]:
    """The daemon-wide weight cache in two or three short lines."""
    dev, host = cache.get("device") or {}, cache.get("host") or {}
    lines = [f"device {fmt_bytes(dev.get('used_bytes', 0))} / {fmt_bytes(dev.get('budget_bytes', 0))}, "
             f"{len(dev.get('models', []))}/{dev.get('cache_size', '-')} models; host "
             f"{fmt_bytes(host.get('used_bytes', 0))} / {fmt_bytes(host.get('budget_bytes', 0))}"
             + (f" ({host['compression']})" if host.get("compression") not in (None, "none") else "")]
    rate = cache.get("hit_rate") or {}
    line = f"hit rate: device {_pct(rate.get('device'))}, host {_pct(rate.get('host'))}; policy {cache.get('policy', '-')}"
    line += f", {cache.get('load_strategy', '-')} loads"
    pf = cache.get("prefetch") or {}
    if pf.get("enabled"):
        line += f"; prefetch {pf.get('used', 0)}/{pf.get('issued', 0)} used ({_pct(pf.get('accuracy'))})"
    lines.append(line)
    return lines


def versions_text(status: dict, name: str) -> str:
    table = status.get("versions")
    if table is None:
        return NOT_REPORTED
    parts = []
    for alias, entry in table.items():
        weights = entry.get("weights") or {}
        if alias != name and name not in weights:
            continue
        total = sum(weights.values()) or 1.0
        served = entry.get("served") or {}
        parts.append(f"{alias} -> " + ", ".join(f"{v} {100 * w / total:.0f}% (served {served.get(v, 0)})"
                                                for v, w in weights.items()))
    return "; ".join(parts) or "none (served as itself)"


def keep_alive_text(m: dict) -> str:
    """How long the model stays on the device idle, and when it leaves by itself."""
    ka = m["keep_alive_s"]
    if m.get("pinned"):
        return "pinned (never leaves by itself)"
    if ka < 0:
        return "forever (never leaves by itself)"
    left = m.get("unload_in_s")
    return f"{ka:g} s idle, then down a tier" + (f"; leaves in {left:.0f} s" if left is not None else "; busy")


def cache_text(state, m: dict | None) -> str:
    status = state.status or {}
    if m is None:
        return "no model selected"
    lines = [f"{m['name']}: {load_progress(state, m['name'], m)}"]
    tiers = m.get("tiers")
    lines.append("residency: " + (", ".join(f"{k} {fmt_bytes(v) if isinstance(v, (int, float)) else v}"
                                           for k, v in tiers.items() if v is not None) if tiers
                                 else f"per tier {NOT_REPORTED}"))
    lines.append("bytes: " + (fmt_bytes(m["weights_bytes"]) if m.get("weights_bytes") is not None else NOT_REPORTED))
    if "keep_alive_s" in m:
        lines.append("keep alive: " + keep_alive_text(m))
    cache = status.get("weight_cache")
    if cache:
        lines += ["weight cache: " + cache_summary(cache)[0], *cache_summary(cache)[1:]]
    else:
        lines.append("weight cache: " + NOT_REPORTED)
    lines.append("version / canary: " + versions_text(status, m["name"]))
    return "\n".join(lines)


class ModelsScreen(ConsoleScreen):
    NAME = "models"
    BINDINGS = [Binding("l", "load", "Load"), Binding("u", "unload", "Unload"), Binding("p", "pin", "Pin/unpin")]

    def body(self) -> ComposeResult:
        yield DataTable(id="models", cursor_type="row")
        yield Panel("Weight cache", id="cache")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for c in COLUMNS:
            table.add_column(c, key=c)
        table.focus()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self.query_one("#cache", Panel).show(cache_text(self.app.state, self.selected()))

    def models(self) -> list[dict]:
        return list((self.app.state.status or {}).get("models", []))

    def draw(self, state) -> None:
        table = self.query_one(DataTable)
        current = self.selected()
        table.clear()
        for m in self.models():
            total = m.get("kv_blocks_total") or 0
            cells = [m["name"], m.get("state", "?"), "yes" if m.get("pinned") else "no", m.get("device", "?"),
                     f"{total - m.get('kv_blocks_free', 0)}/{total}", m.get("num_running", "-"), m.get("num_waiting", "-"),
                     m.get("num_in_flight", "-"), m.get("num_steps", "-"), m.get("max_model_len", "-")]
            table.add_row(*(Text(str(c)) for c in cells), key=m["name"])
        if current is not None and current["name"] in table.rows:
            table.move_cursor(row=table.get_row_index(current["name"]))
        self.query_one("#cache", Panel).show(cache_text(state, self.selected()))

    def selected(self) -> dict | None:
        table = self.query_one(DataTable)
        models = self.models()
        if not table.row_count or table.cursor_row is None:
            return None
        name = table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value
        return next((m for m in models if m["name"] == name), None)

    def action_load(self) -> None:
        def done(name: str | None) -> None:
            if name:
                self.app.act(f"loaded {name}", self.app.feed.load, name)

        self.app.push_screen(PromptScreen("Load which model from the store?", "model name"), done)

    def _confirm(self, question: str, ok: str, fn, *args) -> None:
        def done(yes: bool | None) -> None:
            if yes:
                self.app.act(ok, fn, *args)

        self.app.push_screen(ConfirmScreen(question), done)

    def action_unload(self) -> None:
        m = self.selected()
        if m is None:
            self.notify("no model selected")
            return
        self._confirm(f"Unload {m['name']}? Its {m.get('num_in_flight', 0)} requests in flight finish first "
                      f"(up to the drain timeout), the rest are aborted.", f"unloaded {m['name']}",
                      self.app.feed.unload, m["name"])

    def action_pin(self) -> None:
        m = self.selected()
        if m is None:
            self.notify("no model selected")
            return
        pin = not m.get("pinned")
        self._confirm(f"{'Pin' if pin else 'Unpin'} {m['name']}?" + (" Pinned models are never unloaded." if pin else ""),
                      f"{'pinned' if pin else 'unpinned'} {m['name']}", self.app.feed.pin, m["name"], pin)

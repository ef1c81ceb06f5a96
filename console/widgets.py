"""Small pieces every screen uses: number formats, a text gauge and bar chart, the status bar, panels.

Everything is plain text with at most a style on top, so a screen reads the
same with `NO_COLOR`, in 16 colours, and in a tmux capture.
"""

from __future__ import annotations

import time

from rich.text import Text
from textual.widgets import Static

NOT_REPORTED = "not reported by this daemon"
UNAVAILABLE = "unavailable"
MESSAGE_S = 60.0  # how long "reconnected: ..." stays in the status bar
BLOCKS = " ▁▂▃▄▅▆▇█"
SCREENS = [("1", "dashboard", "Dashboard"), ("2", "requests", "Requests"), ("3", "models", "Models"),
           ("4", "partitions", "Partitions"), ("5", "events", "Events")]


def fmt_ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if v < 1 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def fmt_utc(t: float | None) -> str:
    """HH:MM:SS.s in UTC (servers log in UTC; a recording reads the same anywhere)."""
    if not t:
        return "--:--:--"
    return time.strftime("%H:%M:%S", time.gmtime(t)) + f".{int(t * 10) % 10}"


def victim_cost(v: dict) -> str:
    """A preemption victim's move and cost: `swap 1.5 MiB 2.1 ms`, `recompute 120 tok`."""
    move = v.get("move") or v.get("kind")  # schema 1 named the move "kind"
    parts = [str(move)] if move else []
    moved = v.get("bytes_moved", v.get("bytes"))
    if moved:
        parts.append(fmt_bytes(moved))
    if v.get("seconds") is not None:
        parts.append(f"{v['seconds'] * 1000:.1f} ms")
    if v.get("tokens_to_recompute"):
        parts.append(f"{v['tokens_to_recompute']} tok")
    return " ".join(parts)


def gauge(used: int | None, total: int | None, width: int = 20) -> str:
    """`[#####.....]  52% 41/80`, or `-` when unknown."""
    if used is None or not total:
        return "-"
    frac = max(0.0, min(1.0, used / total))
    filled = round(frac * width)
    return f"[{'#' * filled}{'.' * (width - filled)}] {frac * 100:3.0f}% {used}/{total}"


def bar_chart(values: list[float], width: int, height: int) -> list[str]:
    """The last `width` values as columns of eighth blocks, `height` rows, scaled to the largest; top row first."""
    width, height = max(1, width), max(1, height)
    values = values[-width:]
    top = max(values, default=0.0) or 1.0
    rows = []
    for row in range(height - 1, -1, -1):
        line = []
        for v in values:
            eighths = round(v / top * height * 8) - row * 8
            line.append(BLOCKS[max(0, min(8, eighths))])
        rows.append("".join(line).ljust(width))
    return rows


class Panel(Static):
    """A bordered panel whose title is its job; `show()` replaces its content."""

    def __init__(self, title: str, id: str | None = None, classes: str | None = None):
        super().__init__("", id=id, classes=classes, markup=False)
        self.border_title = title

    def show(self, content) -> None:
        self.update(content)

    def on_resize(self) -> None:
        # Some panels fit their text to their width (the dashboard's chart and Device lines, the arbiter's
        # table): draw the screen again at the new width. A screen shown for the first time is drawn before
        # its layout settles (the wide breakpoint applies later), so its own resize is not enough.
        redraw = getattr(self.screen, "redraw", None)
        if redraw is not None:
            self.call_after_refresh(redraw)


class StatusBar(Static):
    """Two lines on top of every screen: the connection and daemon, then the screens with the current one marked."""

    def __init__(self, current: str):
        super().__init__("", classes="status-bar")
        self.current = current

    def show(self, state) -> None:
        c = state.connection
        mark = {"connected": "● connected", "replay": "▶ replay", "connecting": "○ connecting",
                "disconnected": "✕ DISCONNECTED"}.get(c.state, c.state)
        line = Text(no_wrap=True, overflow="ellipsis")
        line.append(f" {mark} ", style="reverse bold" if c.state == "disconnected" else "bold")
        if c.message and (c.state != "connected" or state.clock() - c.message_t < MESSAGE_S):
            line.append(f" {c.message} ", style="bold")
        st = state.status
        if st and c.state != "disconnected":
            line.append(f" daemon {st.get('version', '?')} pid {st.get('pid', '?')} "
                        f"up {fmt_age(st.get('uptime_s'))} {st.get('state', '')} ")
        line.append(f" {c.where}")
        tabs = Text(no_wrap=True, overflow="ellipsis")
        for key, name, label in SCREENS:
            if name == self.current:
                tabs.append(f"[{key} {label}]", style="reverse bold")
            else:
                tabs.append(f" {key} {label} ")
            tabs.append(" ")
        tabs.append(" ? help", style="dim")
        self.update(Text("\n", no_wrap=True).join([line, tabs]))

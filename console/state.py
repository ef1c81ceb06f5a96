"""What the console knows about the daemon: a pure model fed by the event stream and two polls.

No Textual, no I/O: `ConsoleState.ingest(event)` takes every dict from
`/admin/events`, `set_status` / `set_requests` take the 1 Hz polls of
`/admin/status` and `/admin/requests`, and the screens read the derived views
(`model_views()`, `log()`, ...). `version` goes up on every change, so the app
redraws only when something changed (and at most 4 times a second).

Data the daemon does not report (weight-cache tiers, GPU partitions, hints,
device readings, swap traffic) stays `None` here and the screens say "not
reported by this daemon"; nothing is ever made up. The field names looked for
are listed in `OPTIONAL_SOURCES`, so the panels light up when a daemon starts
reporting them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from gpuservd.events.types import Dropped, Hello, Hint, OtherEvent, Preemption, StepRecord, Swap, read_event

LATENCY_WINDOW = 256  # steps per model in the P50 / P99 window and the chart
RATE_WINDOW_S = 10.0  # tokens/s and swap rates are averaged over this many seconds
LOG_SIZE = 2000  # events kept for the events screen

# Where optional data would come from (key in /admin/status, or event type).
OPTIONAL_SOURCES = {
    "device readings": "status.device.readings",
    "hints": "status.hints or events of type hint",
    "weight cache": "status.weight_cache, status.models[].tiers",
    "partitions": "status.partitions, status.arbiter",
    "swap": "events swap (direction out / in, bytes_moved, seconds), swap_out / swap_in; step field swaps",
}
SWAP_TYPES = ("swap", "swap_out", "swap_in")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(rank) - 1]


def _parts(ring: list[dict]) -> dict[str, float]:
    out = {}
    for label, key in (("forward", "forward_s"), ("sample", "sample_s"), ("scheduler", "decision_s")):
        values = [r[key] * 1000 for r in ring if r.get(key) is not None]
        if values:
            out[label] = percentile(values, 50)
    return out


@dataclass
class ModelView:
    """One model's live numbers, as the dashboard shows them."""

    name: str
    num_steps: int  # steps in the latency window
    p50_ms: float | None  # step wall time over the window; None before the first step
    p99_ms: float | None
    last_ms: float | None  # the newest step
    tokens_per_s: float  # prefill + decode tokens over the rate window
    num_running: int | None  # from /admin/status (None before the first poll)
    num_waiting: int | None
    kv_used: int | None  # KV blocks in use
    kv_total: int | None
    latency_ms: list[float] = field(default_factory=list)  # the window, oldest first (the chart)
    part_p50_ms: dict[str, float] = field(default_factory=dict)  # forward / sample / scheduler: P50 of each part
    tokens_per_step: list[int] = field(default_factory=list)  # prefill + decode tokens of each step in the window


@dataclass
class Connection:
    """Where the console stands with the daemon."""

    state: str = "connecting"  # connecting | connected | disconnected | replay
    where: str = ""  # socket path (or the replayed file)
    message: str = ""  # shown in the status bar: "reconnected: daemon restarted (pid 1 -> 2)", why it is down
    pid: int | None = None  # the daemon's pid when last connected
    num_reconnects: int = 0
    message_t: float = 0.0  # when the message was set (state.clock())


class ConsoleState:
    """Everything the screens draw, fed by a feed (live socket or a recording)."""

    def __init__(self, clock=time.time):
        self.clock = clock  # wall clock; a replay pins it to the recording's end
        self.version = 0
        self.connection = Connection()
        self.status: dict | None = None
        self.requests: list[dict] | None = None
        self._steps: dict[str, deque] = {}  # model -> recent step records
        self._log: deque[dict] = deque(maxlen=LOG_SIZE)
        self._preemptions: dict[tuple, dict] = {}  # (model, step_id) -> its log entry
        self._swaps: deque[dict] = deque(maxlen=LOG_SIZE)  # (t, direction, bytes) for the rates
        self.swap_reported = False
        self._hints: dict[str, dict] = {}  # from hint events: name -> latest
        self.hints_reported = False
        self.num_logged = 0  # entries ever appended to the log (the events screen appends only the new ones)
        self.num_log_edits = 0  # entries changed in place (a derived preemption replaced by the daemon's)
        self.num_events = 0
        self.num_dropped = 0  # events the daemon dropped for us (we fell behind)

    def _changed(self) -> None:
        self.version += 1

    def _append(self, entry: dict) -> None:
        self._log.append(entry)
        self.num_logged += 1

    # ---- feed side -------------------------------------------------------------------------------
    def set_connection(self, state: str, where: str = "", message: str = "", pid: int | None = None) -> None:
        """A feed says where it stands; a new daemon pid after a loss means the daemon restarted."""
        c = self.connection
        if state == "connected" and c.state in ("disconnected", "connected"):
            if c.pid is not None and pid is not None and pid != c.pid:
                message = f"reconnected: the daemon restarted (pid {c.pid} -> {pid})"
                self._steps.clear()  # step ids start again in a new daemon
                self._preemptions.clear()
            elif c.state == "disconnected":
                message = f"reconnected to the same daemon (pid {pid})"
            if message:
                c.num_reconnects += 1
        if message and state in ("connected", "disconnected") and (state, message) != (c.state, c.message):
            self._append({"type": "console", "t": self.clock(), "message": message})
            c.message_t = self.clock()
        c.state, c.where, c.message = state, where or c.where, message
        if pid is not None:
            c.pid = pid
        self._changed()

    def set_status(self, status: dict) -> None:
        self.status = status
        hints = status.get("hints")
        if hints is not None:
            self.hints_reported = True
        self._changed()

    def set_requests(self, rows: list[dict]) -> None:
        self.requests = rows
        self._changed()

    def ingest(self, event: dict) -> None:
        """One event from /admin/events (a step record or anything else), of either schema (read with
        `read_event`). The log and the step rings keep the JSON as it came: a field an older daemon does
        not send stays absent, so a screen says "not reported" rather than show a made-up zero."""
        ev = read_event(event)
        kind = ev.type if not isinstance(ev, OtherEvent) else ev.name
        self.num_events += 1
        if isinstance(ev, Hello):
            return
        if isinstance(ev, StepRecord):
            self._step(event)
        elif isinstance(ev, Preemption):
            key = (event.get("model"), event.get("step_id"))
            entry = self._preemptions.get(key)
            if entry is not None and entry.get("derived"):
                entry.clear()
                entry.update(event)  # the daemon's own record replaces the one derived from the step
                self.num_log_edits += 1
            else:
                self._preemptions[key] = event
                self._append(event)
        else:
            if kind in SWAP_TYPES:
                self.swap_reported = True
                how = ev.direction if isinstance(ev, Swap) else kind  # a daemon that named the type swap_in/out
                self._swaps.append({"t": ev.t or 0.0, "direction": "in" if how.endswith("in") else "out",
                                    "bytes": event.get("bytes", event.get("bytes_moved")) or 0})
            elif isinstance(ev, Hint):
                self.hints_reported = True
                self._hints[str(ev.name or ev.symptom)] = event
            elif isinstance(ev, Dropped):
                self.num_dropped += ev.num_events
            self._append(event)
        self._changed()

    def _step(self, rec: dict) -> None:
        model = rec.get("model", "?")
        ring = self._steps.setdefault(model, deque(maxlen=LATENCY_WINDOW))
        ring.append(rec)
        if "swaps" in rec:  # a daemon with KV swap telemetry (its moves also come as "swap" events, counted there)
            self.swap_reported = True
        if rec.get("num_preempted"):
            key = (model, rec.get("step_id"))
            if key not in self._preemptions:
                # The daemon sends its own "preemption" event right after the step; until it
                # does (or on a daemon that does not), the step's own fields stand for it.
                entry = {"type": "preemption", "t": rec.get("t"), "model": model, "step_id": rec.get("step_id"),
                         "num_preempted": rec["num_preempted"], "request_ids": list(rec.get("preempted_ids") or []),
                         "derived": True}
                self._preemptions[key] = entry
                self._append(entry)

    # ---- views -----------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        names = set(self._steps)
        for m in (self.status or {}).get("models", []):
            names.add(m["name"])
        return sorted(names)

    def model_status(self, name: str) -> dict | None:
        return next((m for m in (self.status or {}).get("models", []) if m.get("name") == name), None)

    def model_views(self) -> list[ModelView]:
        now = self.clock()
        views = []
        for name in self.model_names():
            ring = list(self._steps.get(name, ()))
            lat = [r["wall_s"] * 1000 for r in ring if r.get("wall_s") is not None]
            recent = [r for r in ring if r.get("t", 0) > now - RATE_WINDOW_S]
            span = min(RATE_WINDOW_S, max(now - ring[0].get("t", now), 1e-9)) if ring else RATE_WINDOW_S
            tokens = sum(r.get("num_prefill_tokens", 0) + r.get("num_decode_tokens", 0) for r in recent)
            ms = self.model_status(name) or {}
            total = ms.get("kv_blocks_total")
            used = total - ms["kv_blocks_free"] if total is not None and "kv_blocks_free" in ms else None
            if total is None and ring:
                total, used = ring[-1].get("kv_blocks_total"), ring[-1].get("kv_blocks_used")
            views.append(ModelView(
                name=name, num_steps=len(lat),
                p50_ms=percentile(lat, 50) if lat else None, p99_ms=percentile(lat, 99) if lat else None,
                last_ms=lat[-1] if lat else None, tokens_per_s=tokens / span if recent else 0.0,
                num_running=ms.get("num_running"), num_waiting=ms.get("num_waiting"),
                kv_used=used, kv_total=total, latency_ms=lat, part_p50_ms=_parts(ring),
                tokens_per_step=[r.get("num_prefill_tokens", 0) + r.get("num_decode_tokens", 0) for r in ring]))
        return views

    def log(self, kind: str | None = None) -> list[dict]:
        """The event log, oldest first; kind filters on the event type (swap matches swap_in / swap_out)."""
        if kind is None:
            return list(self._log)
        kinds = SWAP_TYPES if kind == "swap" else (kind,)
        return [e for e in self._log if e.get("type") in kinds]

    def log_since(self, num_logged: int) -> list[dict]:
        """Entries appended after the log held `num_logged` (all kept ones if that is too far back)."""
        n = self.num_logged - num_logged
        return list(self._log)[-n:] if 0 < n < len(self._log) else (list(self._log) if n > 0 else [])

    def log_kinds(self) -> list[str]:
        kinds = {("swap" if e.get("type") in SWAP_TYPES else e.get("type")) for e in self._log}
        return sorted(k for k in kinds if k)

    def recent_preemptions(self, n: int = 5) -> list[dict]:
        return [e for e in self._log if e.get("type") == "preemption"][-n:]

    def swap_rates(self) -> dict[str, float] | None:
        """Bytes/s out and in over the rate window; None when the daemon reports no swap data."""
        if not self.swap_reported:
            return None
        since = self.clock() - RATE_WINDOW_S
        out = {"out": 0.0, "in": 0.0}
        for s in self._swaps:
            if s["t"] > since:
                out[s["direction"]] = out.get(s["direction"], 0.0) + s["bytes"] / RATE_WINDOW_S
        return out

    def hints(self) -> list[dict] | None:
        """The active hints (each with its evidence); None when the daemon reports none at all."""
        if not self.hints_reported:
            return None
        from_status = (self.status or {}).get("hints")
        if from_status is not None:
            return list(from_status)
        return [h for h in self._hints.values() if h.get("active", True)]

    def device_readings(self) -> dict | None:
        readings = ((self.status or {}).get("device") or {}).get("readings")
        return readings if readings else None

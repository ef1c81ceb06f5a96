"""Partitions: SM groups, memory quotas and arbiter shares, as far as the daemon reports them.

The shapes are /admin/status's `partitions` (SharingManager.status: backend, summary, hardware, the plan's
groups and spare, the time-slice group, warnings, error), `quotas` (per model: the plan's terms in bytes,
the KV cap in blocks and the bytes in use) and `arbiter` (Arbiter.status, or `enabled: false` and why).
A daemon that does not send a section gets "not reported by this daemon"; a shape this screen does not
know is shown as a plain table of its keys rather than hidden.
"""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll

from console.screens import ConsoleScreen
from console.widgets import NOT_REPORTED, Panel, fmt_ms

DEFAULT_WIDTH = 76  # an 80-column panel's content, before the first layout
GB, MB = 1e9, 1e6  # decimal, as `gpuserv plan` prints quotas and device memory


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


# ---- formats ---------------------------------------------------------------------------------------

def pct(frac: float | None) -> str:
    """A fraction as a percentage with as many decimals as a small one needs: 60%, 4.5%, 0.06%."""
    if frac is None:
        return "-"
    v = frac * 100
    if v == 0:
        return "0%"
    return f"{v:.2f}%" if abs(v) < 1 else f"{v:.1f}%" if abs(v) < 10 else f"{v:.0f}%"


def fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def size_unit(values) -> tuple[str, float]:
    """GB when the largest value reaches one, else MB (decimal, as `gpuserv plan`)."""
    top = max((v for v in values if isinstance(v, (int, float))), default=0)
    return ("GB", GB) if top >= GB else ("MB", MB)


def in_unit(n, scale: float) -> str:
    return "-" if n is None else f"{n / scale:.1f}"


def grid(headers: list[str], rows: list[list[str]], right: set[str] = frozenset(), wrap: str | None = None) -> Table:
    """A borderless table: bold headers, numbers right-aligned, cells on one line (`wrap` may wrap)."""
    t = Table(box=None, pad_edge=False, show_edge=False, padding=(0, 1), header_style="bold")
    for h in headers:
        t.add_column(h, justify="right" if h in right else "left", no_wrap=h != wrap,
                     overflow="fold" if h == wrap else "ellipsis")
    for r in rows:
        t.add_row(*r)
    return t


def natural_width(headers: list[str], rows: list[list[str]]) -> int:
    """What `grid` needs on one line per row: the widest cell of each column plus the gaps."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    return sum(widths) + 2 * (len(widths) - 1)


# ---- SM partitions ---------------------------------------------------------------------------------

def hardware_line(hw: dict) -> str:
    """`hardware h200 (NVIDIA H200): 132 SMs, compute capability 9.0, 150.8 GB, 4.80 TB/s; ...` as `gpuserv plan`."""
    desc = f" ({hw['description']})" if hw.get("description") and hw.get("description") != hw.get("name") else ""
    parts = [f"{hw.get('num_sms', '?')} SMs"]
    if hw.get("compute_capability") is not None:
        cc = hw["compute_capability"]
        parts.append(f"compute capability {'.'.join(map(str, cc)) if isinstance(cc, (list, tuple)) else cc}")
    if hw.get("memory_bytes") is not None:
        parts.append(f"{hw['memory_bytes'] / GB:.1f} GB")
    if hw.get("mem_bw_bytes_per_s"):
        parts.append(f"{hw['mem_bw_bytes_per_s'] / 1e12:.2f} TB/s")
    line = f"hardware {hw.get('name', '?')}{desc}: {', '.join(parts)}"
    if hw.get("min_partition_sms") is not None and hw.get("alignment_sms") is not None:
        line += f"; partitions of at least {hw['min_partition_sms']} SMs, in steps of {hw['alignment_sms']}"
    return line


def time_slice_models(status: dict, group: str) -> list[str]:
    """The models in the time-sliced group: the arbiter's list, else the models' own `sharing_group`."""
    arbiter = status.get("arbiter")
    if isinstance(arbiter, dict):
        for g in arbiter.get("groups") or []:
            if isinstance(g, dict) and g.get("name") == group:
                return list(g.get("models") or [])
    return [m["name"] for m in status.get("models") or [] if m.get("sharing_group") == group and "name" in m]


def partitions_view(status: dict, p: dict):
    out: list = []
    summary = p.get("summary") or (status.get("sharing") or {}).get("summary")
    head = Text(summary or f"SM partitions: backend {p.get('backend', '?')}", style="bold")
    out.append(head)
    hw = p.get("hardware")
    if isinstance(hw, dict):
        out.append(Text(hardware_line(hw)))
    groups = [g for g in p.get("groups") or [] if isinstance(g, dict)]
    if groups:
        if not p.get("enforced"):
            out.append(Text(f"planned SM groups (not enforced by backend {p.get('backend', '?')}):"))
        rows = [[str(g.get("name", "?")), pct(g.get("share")),
                 "-" if g.get("raw_sms") is None else f"{g['raw_sms']:.1f}",
                 "-" if g.get("num_sms") is None else str(g["num_sms"]), ", ".join(g.get("models") or [])]
                for g in groups]
        if p.get("spare_sms") is not None:
            rows.append(["spare", "", "", str(p["spare_sms"]), "(elastic buffer)"])
        out.append(grid(["group", "share", "ideal", "SMs", "models"], rows, right={"share", "ideal", "SMs"},
                        wrap="models"))
    ts = p.get("time_slice_group")
    if ts:
        models = time_slice_models(status, ts)
        who = f" (group {ts}: {', '.join(models)})" if models else f" (group {ts})"
        out.append(Text(f"time slices: every model shares the whole device{who}"))
    for w in p.get("warnings") or []:
        out.append(Text(f"warning: {w}"))
    if p.get("error"):
        out.append(Text(f"plan error: {p['error']}", style="bold"))
    return Group(*out)


def sm_content(status: dict):
    p = status.get("partitions")
    if not isinstance(p, dict) or not p:
        dev = status.get("device") or {}
        sm = section(status, "partitions")
        if isinstance(sm, str) and dev.get("num_sms"):
            sm += f"\n{dev.get('name')}: {dev['num_sms']} SMs in one group"
        elif isinstance(sm, str) and dev.get("backend") == "cpu":
            sm += "\n(device is a CPU: SM partitions do not apply)"
        return sm
    return partitions_view(status, p)


# ---- memory quotas ---------------------------------------------------------------------------------

def quotas_view(quotas: dict, width: int = DEFAULT_WIDTH):
    if not quotas:
        return Text("no quotas: no model is planned")
    rows_in = {n: q for n, q in quotas.items() if isinstance(q, dict)}
    terms = ("weights", "kv_peak", "activations", "overhead", "quota", "used_bytes")
    unit, scale = size_unit(q.get(k) for q in rows_in.values() for k in terms)
    rows = []
    for name, q in rows_in.items():
        cap = q.get("kv_cap_blocks")
        rows.append([name, in_unit(q.get("weights"), scale), in_unit(q.get("kv_peak"), scale),
                     in_unit(q.get("activations"), scale), in_unit(q.get("overhead"), scale),
                     in_unit(q.get("quota"), scale) + ("*" if q.get("fixed") else ""),
                     in_unit(q.get("used_bytes"), scale), "-" if cap is None else str(cap)])
    headers = ["model", "weights", "KV peak", "activ.", "overhead", "quota", "in use", "KV cap"]
    headroom = next((q.get("headroom") for q in rows_in.values() if q.get("headroom") is not None), None)
    notes = [unit] + ([f"quota = need x {1 + headroom:.2f}"] if headroom is not None else [])
    if any(q.get("kv_cap_blocks") is not None for q in rows_in.values()):
        notes.append("KV cap in blocks (-: the whole pool)")
    estimated = sorted({t for q in rows_in.values() for t, s in (q.get("sources") or {}).items() if s == "estimate"})
    if estimated:
        notes.append(f"{', '.join(estimated)} estimated from the model's shape")
    if any(q.get("fixed") for q in rows_in.values()):
        notes.append("* fixed by memory_quota_bytes")
    return Group(Text(join_to_width(notes, width)), grid(headers, rows, right=set(headers[1:])))


def join_to_width(parts: list[str], width: int, sep: str = "; ") -> str:
    """Parts joined by `sep`, a new line where the next would not fit."""
    lines = [parts[0]]
    for p in parts[1:]:
        if len(lines[-1]) + len(sep) + len(p) <= width:
            lines[-1] += sep + p
        else:
            lines[-1] += sep.rstrip()
            lines.append(p)
    return "\n".join(lines)


def quotas_content(status: dict, width: int = DEFAULT_WIDTH):
    q = status.get("quotas")
    if q is None or (not q and "partitions" not in status):
        return section(status, "quotas")  # not reported: the generic section says so
    if not isinstance(q, dict):
        return section(status, "quotas")
    return quotas_view(q, width)


# ---- arbiter ---------------------------------------------------------------------------------------

ARBITER_HEADERS = ["model", "class", "group", "share", "usage", "duty", "slices", "cut short", "wait s",
                   "P50 ms", "P99 ms", "target ms"]
SPLIT_AT = 6  # at a narrow width the table becomes two: shares (to "duty"), then slices and decode steps


def arbiter_view(a: dict, width: int):
    if not a.get("enabled"):
        return Text(f"arbiter off: {a.get('reason') or 'no reason given'}")
    n = a.get("num_switches") or 0
    switch_ms = (a.get("switch_s") or 0) * 1000
    head = (f"quantum {a.get('quantum_ms', '?')} ms on {a.get('device', '?')}; bandwidth priority "
            f"{'on' if a.get('bandwidth_priority') else 'off'} ({a.get('num_throttle_changes', 0)} throttle changes)\n"
            f"{n} switch{'' if n == 1 else 'es'}, {fmt_ms(switch_ms)} ms switching: "
            f"{pct(a.get('overhead_share'))} of the time")
    out: list = [Text(head)]
    for g in a.get("groups") or []:
        if not isinstance(g, dict):
            continue
        state = f"held by {g['holder']}" if g.get("holder") else "idle"
        if g.get("waiting"):
            state += f", waiting: {', '.join(g['waiting'])}"
        out.append(Text(f"group {g.get('name', '?')}: {', '.join(g.get('models') or []) or 'no model'}; {state}"))
    models = {k: v for k, v in (a.get("models") or {}).items() if isinstance(v, dict)}
    if not models:
        out.append(Text("no model registered"))
        return Group(*out)
    rows = [[name, str(m.get("class", "-")), str(m.get("group", "-")), pct(m.get("share")), pct(m.get("usage")),
             pct(m.get("duty")), str(m.get("num_slices", "-")), str(m.get("num_cut_short", "-")),
             fmt_s(m.get("wait_s")),
             fmt_ms(m.get("decode_step_ms_p50")), fmt_ms(m.get("decode_step_ms_p99")), fmt_ms(m.get("step_target_ms"))]
            for name, m in models.items()]
    right = set(ARBITER_HEADERS[3:])
    if natural_width(ARBITER_HEADERS, rows) <= width:
        out.append(grid(ARBITER_HEADERS, rows, right=right))
    else:
        out.append(grid(ARBITER_HEADERS[:SPLIT_AT], [r[:SPLIT_AT] for r in rows], right=right))
        rest = ["model"] + ARBITER_HEADERS[SPLIT_AT:]
        out.append(grid(rest, [[r[0]] + r[SPLIT_AT:] for r in rows], right=right))
    return Group(*out)


def arbiter_content(status: dict, width: int = DEFAULT_WIDTH):
    a = status.get("arbiter")
    if not isinstance(a, dict) or not a:
        return section(status, "arbiter")
    return arbiter_view(a, width)


class PartitionsScreen(ConsoleScreen):
    NAME = "partitions"

    def body(self) -> ComposeResult:
        with VerticalScroll(id="parts"):
            yield Panel("SM partitions", id="sm")
            yield Panel("Memory quotas", id="quotas")
            yield Panel("Arbiter (time slices, bandwidth)", id="arbiter")

    def draw(self, state) -> None:
        status = state.status or {}
        self.query_one("#sm", Panel).show(sm_content(status))
        quotas = self.query_one("#quotas", Panel)
        quotas.show(quotas_content(status, quotas.content_size.width or DEFAULT_WIDTH))
        arbiter = self.query_one("#arbiter", Panel)
        arbiter.show(arbiter_content(status, arbiter.content_size.width or DEFAULT_WIDTH))

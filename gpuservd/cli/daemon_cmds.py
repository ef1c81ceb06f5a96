"""`gpuserv serve|status|drain|reload|events|logs`, `models load|unload|pin`, `requests ls|cancel`.

Thin commands over gpuservd.api.client; nothing heavy is imported at module
level (the daemon itself is imported only by `serve`). Every command takes
`--socket` (or $GPUSERV_SOCKET) and the read-only ones `--json`. When nothing
answers at the socket the command prints one line saying so and how to start
the daemon, and exits 2.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from gpuservd.api.client import Client
from gpuservd.cli import systemd_cmds
from gpuservd.errors import UserError
from gpuservd.events.types import StepRecord, read_event

SocketOpt = typer.Option(None, "--socket", "-s", envvar="GPUSERV_SOCKET",
                         help="The daemon's Unix socket (default: $XDG_RUNTIME_DIR/gpuserv/gpuserv.sock, "
                              "else /run/gpuserv/gpuserv.sock).")
JsonOpt = typer.Option(False, "--json", help="Print JSON for scripts.")

requests_app = typer.Typer(help="In-flight requests on the daemon.", no_args_is_help=True, add_completion=False)


def _console() -> Console:
    # Piped or captured output is not 80 columns wide: tables (status) keep their cells whole there.
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)


def _client(socket: Optional[Path]) -> Client:
    return Client(socket)


def _echo_json(data) -> None:
    typer.echo(json.dumps(data, indent=2))


# ---- the daemon -------------------------------------------------------------------------------------

def serve(
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Config YAML (default: $GPUSERV_CONFIG, "
                                          "/etc/gpuserv/gpuserv.yaml when present, else built-in defaults)."),
    socket: Optional[str] = typer.Option(None, "--socket", "-s", help="Unix socket path (default: $GPUSERV_SOCKET, "
                                         "/run/gpuserv/gpuserv.sock under systemd, else "
                                         "$XDG_RUNTIME_DIR/gpuserv/gpuserv.sock)."),
    tcp: Optional[str] = typer.Option(None, "--tcp", help="Also serve TCP on HOST:PORT, e.g. 127.0.0.1:8400."),
    model: Optional[list[str]] = typer.Option(None, "--model", "-m", help="Model to load (repeatable; "
                                              "default: server.models, i.e. smollm2)."),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="debug | info | warning | error."),
    demo: Optional[str] = typer.Option(None, "--demo", help="Once ready, send this prompt through the socket and "
                                       "print the reply (the daemon keeps serving)."),
) -> None:
    """Run the daemon in the foreground (Ctrl-C drains and stops). Same as `gpuservd`."""
    from gpuservd.daemon.run import run_daemon  # torch loads with the engine, not at `gpuserv --help`

    code = run_daemon(config, socket, tcp, model, log_level, demo)
    raise typer.Exit(code)


def status(socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Show the daemon: state, device, and per model its KV blocks and queues."""
    with _client(socket) as client:
        if as_json:
            _echo_json(client.status_dict())
            return
        st = client.status()
    console = _console()
    dev = st.device
    console.print(f"gpuservd {st.version} (pid {st.pid}) {st.state}, up {_duration(st.uptime_s)}; "
                  f"{st.num_in_flight} in flight, {st.num_requests_total} served, {st.num_rejected_total} refused",
                  markup=False)
    console.print(f"device: {dev.get('backend')} {dev.get('name', '')}; socket: {st.socket}"
                  + (f"; tcp: {st.tcp}" if st.tcp else ""), markup=False)
    if dev.get("dtype"):
        console.print(f"dtype: {dev['dtype']} ({dev.get('dtype_reason')})", markup=False)
    if st.devices and len(st.devices) > 1:  # several devices: which holds which model
        console.print("devices: " + "; ".join(
            f"{d} {', '.join(v['models']) or '-'} ({v['used_bytes'] / 1e6:.1f}/{v['budget_bytes'] / 1e6:.0f} MB, "
            f"load {v['load']})" for d, v in st.devices.items()), markup=False)
    if st.sharing:
        lc = [m.name for m in st.models if m.sharing_class == "latency_critical"]
        console.print(f"sharing: {st.sharing.get('summary')}; {_arbiter_line(st.arbiter)}"
                      + (f"; latency-critical: {', '.join(lc)}" if lc else ""), markup=False)
    table = Table(box=None, padding=(0, 1), header_style="bold")
    workers = any(m.isolation == "process" for m in st.models)  # the worker column only where one runs
    cols = ("model", "state", "pin", "kv free", "kv total", "run", "wait", "flight", "ctx", "steps")
    for col in cols + (("worker",) if workers else ()):
        table.add_column(col, justify="left" if col in ("model", "state") else "right", no_wrap=True)
    for m in st.models:
        cells = [m.name, m.state, "yes" if m.pinned else "", str(m.kv_blocks_free), str(m.kv_blocks_total),
                 str(m.num_running), str(m.num_waiting), str(m.num_in_flight), str(m.max_model_len), str(m.num_steps)]
        if workers:
            cells.append(str(m.worker_pid) if m.worker_pid else ("starting" if m.isolation == "process" else "-"))
        table.add_row(*cells)
    console.print(table)
    for m in st.models:
        if m.error:
            console.print(f"{m.name}: {m.error}", markup=False)


def _arbiter_line(arb: dict | None) -> str:
    if not arb:
        return "arbiter not reported"
    if not arb.get("enabled"):
        return "arbiter off (naive co-location)"
    throttled = [f"{n} at {100 * x['duty']:.0f}%" for n, x in sorted(arb["models"].items()) if x["duty"] < 1]
    return (f"arbiter: {arb['quantum_ms']:g} ms slices, {arb['num_switches']} switches "
            f"({100 * arb['overhead_share']:.2f}% of the time)"
            + (f", throttled: {', '.join(throttled)}" if throttled else ""))


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def drain(
    socket: Optional[Path] = SocketOpt,
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds to let in-flight requests finish "
                                            "(default: server.drain_timeout)."),
    no_exit: bool = typer.Option(False, "--no-exit", help="Keep the daemon up, refusing requests, until "
                                 "`gpuserv drain --resume`."),
    resume: bool = typer.Option(False, "--resume", help="Admit requests again after a --no-exit drain."),
    as_json: bool = JsonOpt,
) -> None:
    """Stop admitting (503), let in-flight requests finish, abort the rest, and stop the daemon (exit 0)."""
    with _client(socket) as client:
        result = client.resume() if resume else client.drain(timeout, exit=not no_exit)
    if as_json:
        _echo_json(result)
    elif resume:
        typer.echo(f"admitting requests again ({result['state']})")
    else:
        typer.echo(f"drained: {result['num_finished']} finished, {result['num_aborted']} aborted"
                   + ("; the daemon is stopping" if result.get("exiting") else "; refusing requests until "
                      "`gpuserv drain --resume`"))


def reload(socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """Re-read the config file and tenants (as SIGHUP / systemctl reload do)."""
    with _client(socket) as client:
        result = client.reload()
    if as_json:
        _echo_json(result)
        return
    if not result.get("reloaded"):
        raise UserError(f"reload failed, the daemon keeps its config: {result.get('error')}")
    typer.echo(f"reloaded; changed: {', '.join(result['changed']) or 'nothing'}"
               + ("; engine settings apply at the next model load" if result.get("engine_changed") else "")
               + (f"; needs a restart: {', '.join(result['needs_restart'])}" if result.get("needs_restart") else ""))


def events(
    socket: Optional[Path] = SocketOpt,
    types: Optional[list[str]] = typer.Option(None, "--type", "-t", help="Only these event types (repeatable): "
                                              "step, preemption, request_finished, model_load, drain, ..."),
    recent: int = typer.Option(0, "--recent", help="First replay the last N step records."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line (NDJSON)."),
) -> None:
    """Follow the daemon's live event stream (every engine step and every event) until Ctrl-C."""
    with _client(socket) as client:
        for event in client.events(types, recent):
            typer.echo(json.dumps(event) if as_json else _event_line(event))


def _event_line(data: dict) -> str:
    e = read_event(data)
    t = time.strftime("%H:%M:%S", time.localtime(e.t or time.time()))
    if isinstance(e, StepRecord):
        return (f"{t} step {e.model}#{e.step_id}: {e.wall_s * 1000:.1f} ms, prefill {e.num_prefill_tokens}"
                f" decode {e.num_decode_tokens}, running {e.num_running} waiting {e.num_waiting}, "
                f"KV {e.kv_blocks_used}/{e.kv_blocks_total}"
                + (f", preempted {e.num_preempted}" if e.num_preempted else ""))
    rest = ", ".join(f"{k}={v}" for k, v in data.items() if k not in ("type", "t"))
    return f"{t} {data.get('type')}: {rest}"


def logs(
    user: bool = typer.Option(False, "--user", help="The user unit (systemctl --user)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines."),
    lines: int = typer.Option(100, "--lines", "-n", help="How many recent lines."),
) -> None:
    """The daemon's log under systemd (journalctl -u gpuservd); `gpuserv serve` logs to its terminal."""
    journalctl = shutil.which("journalctl")
    if journalctl is None:
        raise UserError("journalctl is not installed; a daemon started with `gpuserv serve` logs to its terminal")
    cmd = [journalctl] + (["--user"] if user else []) + ["-u", "gpuservd", "-n", str(lines), "--no-pager"]
    if follow:
        cmd.append("-f")
    os.execv(journalctl, cmd)


# ---- models on the daemon ----------------------------------------------------------------------------

def models_load(
    name: str = typer.Argument(..., help="A model in the store (gpuserv models ls)."),
    pin: bool = typer.Option(False, "--pin", help="Pin it: never unloaded until unpinned."),
    socket: Optional[Path] = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Load a model on the daemon (returns when it serves)."""
    with _client(socket) as client:
        m = client.load(name, pinned=pin)
    if as_json:
        _echo_json(m)
    else:
        typer.echo(f"{m['name']} {m['state']}: {m['kv_blocks_total']} KV blocks of {m['kv_block_size']} tokens, "
                   f"context {m['max_model_len']}{', pinned' if m['pinned'] else ''}")


def models_unload(
    name: str = typer.Argument(..., help="A loaded model."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="Seconds to let its requests finish "
                                            "(default: server.drain_timeout); the rest are aborted."),
    force: bool = typer.Option(False, "--force", help="Unload even if pinned."),
    socket: Optional[Path] = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Unload a model from the daemon, after its in-flight requests finish."""
    with _client(socket) as client:
        result = client.unload(name, timeout, force)
    if as_json:
        _echo_json(result)
    else:
        typer.echo(f"unloaded {name}: {result['num_finished']} requests finished, {result['num_aborted']} aborted")


def models_pin(
    name: str = typer.Argument(..., help="A loaded model."),
    off: bool = typer.Option(False, "--off", help="Unpin instead."),
    socket: Optional[Path] = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Pin a loaded model (it is never unloaded or evicted) or unpin it with --off."""
    with _client(socket) as client:
        result = client.pin(name, not off)
    if as_json:
        _echo_json(result)
    else:
        typer.echo(f"{name} {'pinned' if result['pinned'] else 'unpinned'}")


def models_versions(
    name: str = typer.Argument(..., help="The name clients ask for."),
    weights: Optional[list[str]] = typer.Argument(None, help="VERSION=WEIGHT pairs, e.g. smollm2=90 smollm2-ft=10."),
    clear: bool = typer.Option(False, "--clear", help="Serve NAME as itself again."),
    socket: Optional[Path] = SocketOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Split NAME's traffic over versions by weight (a canary); responses name the version that served."""
    table: dict[str, float] = {}
    for pair in weights or []:
        version, sep, w = pair.partition("=")
        try:
            table[version] = float(w)
        except ValueError:
            raise UserError(f"expected VERSION=WEIGHT like smollm2-ft=10, got {pair!r}") from None
        if not sep or not version:
            raise UserError(f"expected VERSION=WEIGHT like smollm2-ft=10, got {pair!r}")
    if not table and not clear:
        raise UserError("give VERSION=WEIGHT pairs, or --clear")
    with _client(socket) as client:
        result = client.set_versions(name, None if clear else table)
    if as_json:
        _echo_json(result)
    elif result["versions"]:
        total = sum(result["versions"].values())
        typer.echo(f"{name}: " + ", ".join(f"{v} {100 * w / total:.0f}%" for v, w in result["versions"].items()))
    else:
        typer.echo(f"{name}: served as itself")


# ---- requests ---------------------------------------------------------------------------------------

@requests_app.command("ls")
def requests_ls(socket: Optional[Path] = SocketOpt, as_json: bool = JsonOpt) -> None:
    """List the daemon's unfinished requests."""
    with _client(socket) as client:
        rows = client.requests()
    if as_json:
        _echo_json(rows)
        return
    if not rows:
        typer.echo("no requests in flight")
        return
    table = Table(box=None, padding=(0, 1), header_style="bold")
    for col in ("request id", "model", "tenant", "uid", "state", "age", "prompt", "output", "preempted"):
        table.add_column(col, no_wrap=True)
    table.add_column("sampling")  # what applies: temperature, penalties, seed, logprobs, grammar, tools, n
    for r in rows:
        table.add_row(r["request_id"], r["model"], r["tenant"], str(r["uid"]), r["state"], f"{r['age_s']:.1f}s",
                      str(r["num_prompt_tokens"]), str(r["num_output_tokens"]), str(r["num_preemptions"]),
                      r.get("sampling", ""))
    _console().print(table)


@requests_app.command("cancel")
def requests_cancel(request_id: str = typer.Argument(..., help="From `gpuserv requests ls` or X-Request-Id."),
                    socket: Optional[Path] = SocketOpt) -> None:
    """Cancel a request: it ends with finish reason abort and its KV blocks are freed."""
    with _client(socket) as client:
        client.cancel(request_id)
    typer.echo(f"cancelled {request_id}")


def register(app: typer.Typer, models_app: typer.Typer) -> None:
    """Mount these commands on the main CLI and on `gpuserv models`."""
    app.command()(serve)
    app.command()(status)
    app.command()(drain)
    app.command()(reload)
    app.command()(events)
    app.command()(logs)
    app.add_typer(requests_app, name="requests")
    app.add_typer(systemd_cmds.app, name="systemd")
    models_app.command("load")(models_load)
    models_app.command("unload")(models_unload)
    models_app.command("pin")(models_pin)
    models_app.command("versions")(models_versions)

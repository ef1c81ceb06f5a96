"""Command line of the console, shared by `python -m console` and `gpuserv top`."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from console.app import ConsoleApp, DEFAULT_HZ, MAX_HZ
from console.feed import record as do_record
from console.widgets import SCREENS
from gpuservd.errors import UserError


def run(socket: str | Path | None = None, replay: Path | None = None, record: Path | None = None,
        seconds: float = 30.0, refresh_hz: float = DEFAULT_HZ, screen: str = "dashboard") -> None:
    """Open the console on the daemon at `socket` (or a recording), or record what it would see."""
    names = [name for _, name, _ in SCREENS]
    if screen not in names:
        raise UserError(f"--screen {screen!r} is unknown; choose one of: {', '.join(names)}")
    if replay is not None and not Path(replay).is_file():
        raise UserError(f"no recording at {replay}")
    if record is not None:
        n = asyncio.run(do_record(record, socket, seconds))
        print(f"recorded {n} lines into {record}", file=sys.stderr)
        return

    app = (ConsoleApp.replay(replay, refresh_hz=refresh_hz, start=screen) if replay is not None
           else ConsoleApp.live(socket, refresh_hz=refresh_hz, start=screen))
    app.run()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m console", description="gpuserv top: the operations console.")
    p.add_argument("--socket", type=Path, default=None, help="daemon socket (default: $GPUSERV_SOCKET, as the CLI)")
    p.add_argument("--replay", type=Path, default=None, help="show a recording instead of the live daemon")
    p.add_argument("--record", type=Path, default=None, help="record the daemon's stream into this file and exit")
    p.add_argument("--seconds", type=float, default=30.0, help="how long --record records")
    p.add_argument("--refresh", type=float, default=DEFAULT_HZ, help=f"redraws a second (at most {MAX_HZ:g})")
    p.add_argument("--screen", default="dashboard",
                   choices=["dashboard", "requests", "models", "partitions", "events"])
    a = p.parse_args(argv)

    try:
        run(a.socket, a.replay, a.record, a.seconds, a.refresh, a.screen)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)

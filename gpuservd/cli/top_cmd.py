"""`gpuserv top`: the operations console (the Textual app lives in the `console` package)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpuservd.cli.daemon_cmds import SocketOpt


def top(
    socket: Optional[Path] = SocketOpt,
    replay: Optional[Path] = typer.Option(None, "--replay", help="Show a recording (from --record) instead of the "
                                          "live daemon."),
    record: Optional[Path] = typer.Option(None, "--record", help="Record what the console sees into this NDJSON "
                                          "file for --seconds, then exit."),
    seconds: float = typer.Option(30.0, "--seconds", help="How long --record records."),
    refresh: float = typer.Option(2.0, "--refresh", help="Redraws a second (at most 4)."),
    screen: str = typer.Option("dashboard", "--screen", help="The first screen: dashboard, requests, models, "
                               "partitions or events."),
) -> None:
    """The operations console: per-step latency, requests, models, events, live over the socket (also `python -m console`)."""
    from console.cli import run  # Textual only when the console opens

    run(socket, replay, record, seconds, refresh, screen)


def register(app: typer.Typer) -> None:
    app.command()(top)

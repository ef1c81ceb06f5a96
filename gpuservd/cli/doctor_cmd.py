"""`gpuserv doctor [--json]`: the box's and the daemon's health checks plus the active hints.

Exit code 0 when healthy, 1 with warnings, 2 with critical problems (see gpuservd/daemon/doctor.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from gpuservd.cli import daemon_cmds

MARKS = {"ok": "ok", "info": "info", "skip": "skip", "warn": "WARN", "critical": "CRIT"}


def doctor(socket: Optional[Path] = daemon_cmds.SocketOpt, as_json: bool = daemon_cmds.JsonOpt) -> None:
    """Check Python, torch and CUDA, the driver and NVML, green contexts, MPS, disk, socket, systemd and the
    daemon; list the active hints. Exit 0 healthy, 1 warnings, 2 critical."""
    from gpuservd.daemon.doctor import run_checks  # the checks pull the GPU backends: only for `gpuserv doctor`

    report = run_checks(socket)
    if as_json:
        typer.echo(json.dumps(report, indent=2))
    else:
        for c in report["checks"]:
            typer.echo(f"{MARKS[c['status']]:>4}  {c['name']:<15} {c['summary']}")
        verdict = {0: "healthy", 1: "warnings", 2: "critical problems"}[report["exit_code"]]
        typer.echo(f"doctor: {verdict}")
    raise typer.Exit(report["exit_code"])


def register(app: typer.Typer) -> None:
    app.command()(doctor)

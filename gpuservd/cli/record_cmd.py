"""`gpuserv record --out trace.jsonl [--seconds N] [--with-prompts]`: live traffic as a replayable trace."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from gpuservd.cli import daemon_cmds


def record(
    out: Path = typer.Option(..., "--out", "-o", help="Trace file to write (JSONL, the bench's trace format)."),
    seconds: Optional[float] = typer.Option(None, "--seconds", min=0.1, help="Stop after this long "
                                            "(default: until Ctrl-C)."),
    with_prompts: bool = typer.Option(False, "--with-prompts", help="Keep each prompt's text (left out by default)."),
    socket: Optional[Path] = daemon_cmds.SocketOpt,
) -> None:
    """Record live traffic (arrival times, models, lengths, tenants, priorities) for `gpuserv bench -w FILE`."""
    from gpuservd.bench.record import record as run  # numpy: only when recording

    rec = run(daemon_cmds._client(socket), out, seconds, with_prompts, log=lambda m: typer.echo(m, err=True))
    models = ", ".join(f"{m} {n}" for m, n in sorted(rec.models.items())) or "none"
    typer.echo(f"{rec.num_written} requests recorded to {out} ({models}); {rec.num_skipped} skipped "
               f"(failed, empty, or arrived before the recording). Replay: gpuserv bench -w {out}")


def register(app: typer.Typer) -> None:
    app.command()(record)

"""The daemon process: its lifecycle (run.py), systemd integration (sdnotify.py, systemd_units.py) and
`gpuserv doctor`'s checks (doctor.py)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    """The `gpuservd` console script (pyproject.toml) and `python -m gpuservd.daemon`."""
    # Imported here so that `gpuserv` (which imports systemd_units and doctor from this package) does
    # not load the daemon's run-time modules to print its help.
    from gpuservd.daemon.run import main as run_main

    run_main(argv)

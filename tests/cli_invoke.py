"""Run the CLI the way the console script does: main() turns a UserError into one line and exit 2."""

from __future__ import annotations

import sys


def invoke(*args):
    """gpuserv ARGS in this process; returns the exit code (0 when main() returns)."""
    from gpuservd.cli import main as cli_main

    argv = sys.argv
    sys.argv = ["gpuserv", *args]
    try:
        cli_main.main()
    except SystemExit as exc:
        return exc.code
    finally:
        sys.argv = argv
    return 0

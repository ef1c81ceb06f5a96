"""The interpreter's GIL switch interval in the daemon (GPUSERV_GIL_SWITCH_INTERVAL_MS).

The daemon's event loop shares one interpreter with the engine threads, which hold the GIL while they run
a step's Python between torch ops. A thread that wants the GIL asks the holder to drop it and waits up to
the switch interval (`sys.setswitchinterval`, Python's default 5 ms) before the holder is made to: a scrape
or a new request that arrives while the engine runs Python waits up to that long before the loop can parse
it. A shorter interval bounds that wait; the engine pays a little more GIL hand-over meanwhile.
"""

from __future__ import annotations

import os
import sys

from gpuservd.errors import UserError

SWITCH_INTERVAL_ENV = "GPUSERV_GIL_SWITCH_INTERVAL_MS"
DEFAULT_SWITCH_INTERVAL_MS = 5.0  # Python's own
MIN_MS, MAX_MS = 0.05, 100.0


def switch_interval_ms() -> float:
    """The configured interval in ms; a bad value is a UserError naming the variable (the start stops)."""
    raw = os.environ.get(SWITCH_INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_SWITCH_INTERVAL_MS
    try:
        value = float(raw)
    except ValueError:
        raise UserError(f"{SWITCH_INTERVAL_ENV} must be a number of milliseconds, got {raw!r}") from None
    if not MIN_MS <= value <= MAX_MS:
        raise UserError(f"{SWITCH_INTERVAL_ENV} must be between {MIN_MS} and {MAX_MS} ms, got {value}")
    return value


def apply_switch_interval() -> float:
    """Set the interpreter's switch interval from the environment; returns it in seconds."""
    seconds = switch_interval_ms() / 1e3
    sys.setswitchinterval(seconds)
    return sys.getswitchinterval()

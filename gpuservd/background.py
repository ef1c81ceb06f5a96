"""Work started on a thread beside a load, whose result (or error) is taken where it is first needed."""

from __future__ import annotations

import threading
from concurrent.futures import Future


def in_background(name: str, fn, *args, **kwargs) -> Future:
    """Run fn(*args, **kwargs) on a daemon thread; `.result()` waits and returns it, or raises its error
    in the caller's thread."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # raised where the result is taken
            fut.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut

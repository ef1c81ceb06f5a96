"""Run part of a test as another local user (the hostile side), the way an attacker on the box would.

The tests run as root; `as_user(fn)` forks, drops to uid/gid 65534 (nobody) with no supplementary
groups, runs fn there and hands its return value (or its exception, as text) back through a pipe.
`open_dir(prefix)` makes a directory under /tmp that such a user can reach (pytest's tmp_path is 0700).
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
from pathlib import Path

import pytest

NOBODY = 65534


def require_root() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to act as another uid")


def as_user(fn, uid: int = NOBODY, gid: int = NOBODY, timeout: float = 60.0):
    """fn() run in a forked child as uid/gid; returns its result, raises RuntimeError with its error."""
    require_root()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            signal_alarm(timeout)
            try:
                payload = ("ok", fn())
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                payload = ("error", f"{type(exc).__name__}: {exc}")
            with os.fdopen(w, "wb") as f:
                pickle.dump(payload, f)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    if not data:
        raise RuntimeError("the child running as another user died without an answer")
    kind, value = pickle.loads(data)
    if kind == "error":
        raise RuntimeError(value)
    return value


def signal_alarm(seconds: float) -> None:
    import signal

    signal.alarm(max(1, int(seconds)))  # a hung child dies instead of hanging the test


def open_dir(prefix: str) -> Path:
    """A fresh directory under /tmp that any user may enter (and not write); remove it with shutil."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)

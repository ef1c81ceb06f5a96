"""File-system helpers for atomic publishing: temp names, fsync, modes, stale cleanup.

Temp entries are named `.tmp-<what>-<pid>-<tag>` so that a later process can tell
whether their writer is still alive and remove them only when it is not.
"""

from __future__ import annotations

import os
import re
import shutil
import time
import uuid
from pathlib import Path

TMP_RE = re.compile(r"^\.tmp-(?P<what>.+)-(?P<pid>\d+)-(?P<tag>[a-z0-9_]+)$")
# A temp entry this old is stale even if its pid was reused by an unrelated process.
STALE_AFTER_S = 24 * 3600


def tmp_name(what: str) -> str:
    """A fresh temp entry name owned by this process."""
    return f".tmp-{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (its temp entries may still be in use)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_tmp(directory: Path) -> list[Path]:
    """Remove temp entries in `directory` left by processes that are gone; return them."""
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    now = time.time()
    for entry in directory.iterdir():
        match = TMP_RE.match(entry.name)
        if not match:
            continue
        pid = int(match["pid"])
        try:
            age = now - entry.lstat().st_mtime
        except OSError:
            continue
        # Our own pid is skipped: another thread of this process may be writing it.
        if pid == os.getpid() or (pid_alive(pid) and age < STALE_AFTER_S):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def fsync_path(path: Path) -> None:
    """fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file, then every directory, under root."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for filename in filenames:
            fsync_path(Path(dirpath) / filename)
        fsync_path(Path(dirpath))


def current_umask() -> int:
    """The process umask, read without os.umask() (which would change it for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def set_default_modes(root: Path, narrow: dict[str, int] | None = None) -> None:
    """Give dirs 0755 and files 0644 (less the umask), as a plain mkdir/write would.

    Temp dirs are created 0700 and some writers (safetensors) make files 0600; a
    published model should be readable like any other file its owner writes.
    narrow: top-level file name -> bits it may have at most (the owner keeps read/write).
    """
    mask = current_umask()
    narrow = narrow or {}
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755 & ~mask)
        top = Path(dirpath) == Path(root)
        for filename in filenames:
            bits = 0o644 & ~mask
            if top and filename in narrow:
                bits &= narrow[filename] | 0o600
            os.chmod(Path(dirpath) / filename, bits)

"""vLLM's router (the `vllm-router` package: a Rust binary behind a Python launcher) in a venv of its own.

Installed once into a cache directory and reused by later runs: pip runs only
when the venv lacks the pinned version. Where it cannot be installed (no
package index, no wheel for this platform) `router_bin()` says why, and the
test skips with that reason.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

VERSION = "0.1.17"  # pinned: the flags and the request fields it adds are this version's
INSTALL_TIMEOUT_S = 600


def cache_dir() -> Path:
    base = os.environ.get("GPUSERV_TEST_CACHE") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "gpuserv-tests" / f"vllm-router-{VERSION}"


def router_bin() -> tuple[Path | None, str]:
    """(the vllm-router executable, "") or (None, why it cannot be had)."""
    venv = cache_dir()
    exe = venv / "bin" / "vllm-router"
    stamp = venv / ".installed"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".vllm-router-{VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time; the others wait, then reuse it
        if stamp.exists() and exe.exists():
            return exe, ""
        try:
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True,
                           timeout=120)
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            done = subprocess.run(pip + [f"vllm-router=={VERSION}"], capture_output=True, text=True,
                                  timeout=INSTALL_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"cannot make a venv for vllm-router {VERSION} in {venv}: {exc}"
        if done.returncode != 0 or not exe.exists():
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            return None, f"pip cannot install vllm-router=={VERSION} into {venv}: {tail}"
        stamp.write_text(VERSION + "\n")
        return exe, ""

"""The daemon raises its soft open-file limit to the hard one (at most FD_LIMIT): under a shell's soft
limit one user's burst of connections could spend every descriptor and stall accepts for everyone."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

from gpuservd.daemon.run import FD_LIMIT

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import resource
from gpuservd.daemon.run import raise_fd_limit
print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _run_with_soft_limit(soft: int) -> tuple[int, int]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
    assert r.returncode == 0, r.stderr
    said, now = map(int, r.stdout.split())
    return said, now


def test_a_low_soft_limit_is_raised_to_the_hard_one():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT)
    said, now = _run_with_soft_limit(min(256, want))
    assert said == now == want


def test_a_soft_limit_already_high_is_left_alone():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    want = FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT)
    said, now = _run_with_soft_limit(want)
    assert said == now == want

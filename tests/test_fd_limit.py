"""The daemon raises its soft open-file limit to the hard one (at most FD_LIMIT): under a shell's soft
limit one user's burst of connections could spend every descriptor and stall accepts for everyone."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from gpuservd.daemon.run import FD_LIMIT

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import resource
from gpuservd.daemon.run import raise_fd_limit
print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def _want() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return FD_LIMIT if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT)


def _start_with_soft_limit(soft: int) -> subprocess.Popen:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return subprocess.Popen([sys.executable, "-c", SCRIPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                                       (soft, hard)))


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[int, int]]:
    """(what raise_fd_limit said, the soft limit after it) in a process started under a low soft limit and in
    one started at the target already; both started at once (each is mostly `import torch`)."""
    procs = {"low": _start_with_soft_limit(min(256, _want())), "high": _start_with_soft_limit(_want())}
    try:
        got = {}
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            said, now = map(int, out.split())
            got[name] = (said, now)
        yield got
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_a_low_soft_limit_is_raised_to_the_hard_one(runs):
    said, now = runs["low"]
    assert said == now == _want()


def test_a_soft_limit_already_high_is_left_alone(runs):
    said, now = runs["high"]
    assert said == now == _want()

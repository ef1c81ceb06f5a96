"""The bench's process-tree sampler finds a server's descendants from /proc/PID/task/*/children, and by
scanning /proc where the kernel lacks those files; both give the same tree."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from gpuservd.bench import proc_tree


@pytest.fixture()
def tree():
    """A shell with two children, one of which has a child of its own (a grandchild of the root)."""
    p = subprocess.Popen(["bash", "-c", "sleep 60 & bash -c 'sleep 60 & wait' & wait"])
    try:
        deadline = time.monotonic() + 10
        while len(proc_tree._tree_pids_by_scan(p.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        yield p.pid
    finally:
        for pid in reversed(proc_tree._tree_pids_by_scan(p.pid)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait()


def test_the_walk_finds_children_and_grandchildren(tree):
    walked = proc_tree.tree_pids(tree)
    assert walked[0] == tree
    assert sorted(walked) == sorted(proc_tree._tree_pids_by_scan(tree))
    assert len(walked) == 4  # bash, its sleep, the inner bash and its sleep
    assert proc_tree.cpu_seconds(walked) >= 0 and proc_tree.rss_bytes(walked) > 0


def test_without_children_files_it_scans(tree, monkeypatch):
    monkeypatch.setattr(proc_tree, "_children", lambda pid: None)
    assert sorted(proc_tree.tree_pids(tree)) == sorted(proc_tree._tree_pids_by_scan(tree))
    assert len(proc_tree.tree_pids(tree)) == 4


def test_a_process_that_is_gone_is_its_tree_alone():
    p = subprocess.Popen(["true"])
    p.wait()
    assert proc_tree.tree_pids(p.pid) == [p.pid]  # its CPU and RSS read as 0, as under the scan

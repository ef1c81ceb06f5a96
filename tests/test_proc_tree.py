"""The bench's process-tree sampler finds a server's descendants from /proc/PID/task/*/children, and by
scanning /proc where the kernel lacks those files; both give the same tree."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from gpuservd.bench import proc_tree


def _kill_tree(p: subprocess.Popen) -> None:
    for pid in reversed(proc_tree._tree_pids_by_scan(p.pid)):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


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
        _kill_tree(p)


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


# A root that only waits, and a child that burns 0.3 s of its own CPU and then sleeps (alive at stop, so its
# CPU is still read): a server whose front process hands the work to an engine worker.
FRONT_AND_WORKER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import time\\nwhile time.process_time() < 0.3: pass\\nprint('done', flush=True)\\ntime.sleep(60)"],
    stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
time.sleep(60)
"""


def test_the_front_process_share_is_kept_apart():
    p = subprocess.Popen([sys.executable, "-c", FRONT_AND_WORKER], stdout=subprocess.PIPE, text=True)
    try:
        sampler = proc_tree.TreeSampler(p.pid, interval_s=0.05).start()
        assert p.stdout.readline().strip() == "done"  # the child has burnt its 0.3 s
        sampler.stop()
        s = sampler.summary(tokens=100)
        assert s["server_cpu_s"] >= 0.25  # the child's CPU counts for the server ...
        assert s["front_cpu_s"] < s["server_cpu_s"] - 0.2  # ... and not for its front process
        assert s["front_cpu_ms_per_token"] == pytest.approx(1000 * s["front_cpu_s"] / 100, abs=1e-3)
    finally:
        _kill_tree(p)


# -- a bench killed with SIGTERM stops the server it started ------------------------------------------
BENCH = """
import socket, sys, time
from pathlib import Path
from gpuservd.bench.server_process import ServerProcess, ServerSpec
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
spec = ServerSpec(name="http.server", cmd=[sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                  ready_path="/", base_url=f"http://127.0.0.1:{port}", ready_timeout_s=60)
with ServerProcess(spec, Path(sys.argv[1])) as server:
    print(server.pid, flush=True)
    time.sleep(120)
"""


def test_a_bench_ended_by_sigterm_stops_its_server(tmp_path):
    """`timeout` around a bench sends SIGTERM: the server (in a session of its own) must not outlive it."""
    bench = subprocess.Popen([sys.executable, "-c", BENCH, str(tmp_path / "server.log")], stdout=subprocess.PIPE,
                             text=True)
    server_pid = int(bench.stdout.readline())
    assert os.path.exists(f"/proc/{server_pid}")
    try:
        bench.send_signal(signal.SIGTERM)
        bench.wait(60)
        deadline = time.monotonic() + 30
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid)
    finally:
        if _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

"""The OpenMP pool's worker threads can run at a lower CPU priority than the daemon's Python threads
(runner/omp.py PoolPriority; GPUSERV_OMP_WORKER_PRIORITY: SCHED_IDLE or a nice value, nothing lowered by
default): the event loop preempts a worker when it wakes, while the engine's own thread, which holds the GIL
between ops, keeps its priority. Checked in a fresh process (nice values are
per thread and a test process's other threads would be in the sweep)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpuservd.errors import UserError
from gpuservd.runner.omp import DEFAULT_THREADS, WORKER_PRIORITY_ENV, worker_priority

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, os, sys, threading
from pathlib import Path

import torch

from gpuservd.engine.loop import EngineLoop, Submission
from gpuservd.engine.request import RequestOutput, SamplingParams
sys.path.insert(0, sys.argv[2])
from test_engine import make_engine
from test_stream_path import _RecordingLoop

done = threading.Event()
engine_tid = []

class Hooks:
    def on_step(self, model, record, outputs):
        if not engine_tid:  # on the engine thread: a parallel op on its full team makes the pool's workers
            engine_tid.append(threading.get_native_id())
            torch.ones(1 << 22).exp_()

    def on_abort(self, model, output):
        pass

class Sink:
    def put(self, item):
        if isinstance(item, RequestOutput) and item.finished:
            done.set()

loop = EngineLoop("tiny", lambda: make_engine(Path(sys.argv[1])), _RecordingLoop(),
                  lambda d, e: [s.put(i) for s, i in d], hooks=Hooks())
loop.submit(Submission("r1", [3, 4, 5, 6], SamplingParams(max_tokens=6, ignore_eos=True), Sink()))
loop.start()
assert done.wait(120)
def level(t):  # "idle" for SCHED_IDLE, else the nice value
    return "idle" if os.sched_getscheduler(t) == os.SCHED_IDLE else os.getpriority(os.PRIO_PROCESS, t)
nice = {int(t): level(int(t)) for t in os.listdir("/proc/self/task")}
python = sorted(t.native_id for t in threading.enumerate())
loop.stop()
print(json.dumps({"nice": nice, "python": python, "engine": engine_tid[0], "main": threading.get_native_id()}))
"""


def _start(tiny_model_dir, nice: str | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != WORKER_PRIORITY_ENV}
    env["PYTHONPATH"] = str(ROOT)
    if nice is not None:
        env[WORKER_PRIORITY_ENV] = nice
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(ROOT / "tests")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    got["nice"] = {int(k): v for k, v in got["nice"].items()}
    return got


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    """The four settings' processes, started together: each is its own process with its own threads (the
    sweep reads /proc/self/task), so they do not see each other, and most of each one's time is its imports."""
    procs = {nice: _start(tiny_model_dir, nice) for nice in ("7", "0", "idle", None)}
    try:
        yield {nice: _result(proc) for nice, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="one CPU: the engine's team has no worker threads")
@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) != 0, reason="the test process already runs niced")
def test_the_pools_workers_are_lowered_and_the_python_threads_are_not(runs):
    got = runs["7"]
    workers = {t: n for t, n in got["nice"].items() if t not in got["python"]}
    assert workers, got  # the engine's team made at least one worker thread
    assert set(workers.values()) == {7}, got
    assert got["nice"][got["engine"]] == 0 and got["nice"][got["main"]] == 0, got
    assert all(got["nice"][t] == 0 for t in got["python"] if t in got["nice"]), got


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="one CPU: the engine's team has no worker threads")
@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) != 0, reason="the test process already runs niced")
def test_nice_zero_leaves_every_thread_as_it_was(runs):
    got = runs["0"]
    assert len(got["nice"]) > len(got["python"]) and set(got["nice"].values()) == {0}, got


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="one CPU: the engine's team has no worker threads")
@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) != 0, reason="the test process already runs niced")
def test_by_default_no_thread_is_lowered(runs):
    """A lowered worker starves whenever other work wants the cores (the engine thread spins at each op's
    barrier for it: ~10x slower steps on a loaded machine, runner/omp.py), so nothing is lowered unless asked."""
    got = runs[None]
    assert len(got["nice"]) > len(got["python"]) and set(got["nice"].values()) == {0}, got


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="one CPU: the engine's team has no worker threads")
@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) != 0, reason="the test process already runs niced")
def test_idle_runs_the_workers_under_sched_idle(runs):
    got = runs["idle"]
    workers = {t: n for t, n in got["nice"].items() if t not in got["python"]}
    assert workers and set(workers.values()) == {"idle"}, got
    assert got["nice"][got["engine"]] == 0 and got["nice"][got["main"]] == 0, got


def test_a_bad_priority_says_what_to_set(monkeypatch):
    monkeypatch.setenv(WORKER_PRIORITY_ENV, "high")
    with pytest.raises(UserError, match=WORKER_PRIORITY_ENV):
        worker_priority()
    monkeypatch.setenv(WORKER_PRIORITY_ENV, "25")
    with pytest.raises(UserError, match="0-19 or 'idle'"):
        worker_priority()
    monkeypatch.setenv(WORKER_PRIORITY_ENV, " IDLE ")
    assert worker_priority() == "idle"
    monkeypatch.setenv(WORKER_PRIORITY_ENV, "")
    assert worker_priority() == 0


def test_the_daemon_refuses_to_start_with_a_bad_priority(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), WORKER_PRIORITY_ENV: "high", "GPUSERV_HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "gpuservd.daemon", "--socket", str(tmp_path / "s.sock")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert r.returncode == 2 and WORKER_PRIORITY_ENV in r.stderr, (r.returncode, r.stderr[-2000:])


def test_no_sweep_while_a_python_thread_is_starting(monkeypatch):
    """A Python thread whose id threading does not know yet is not taken for a pool worker: the sweep waits."""
    import threading

    from gpuservd.runner import omp

    class Starting:
        native_id = None

    monkeypatch.setattr(threading, "enumerate", lambda: [threading.current_thread(), Starting()])
    assert omp.demote_pool_workers(19) is None
    pool = omp.PoolPriority(19)
    pool.after_step()
    assert pool._threads == 0  # tried again at the next step

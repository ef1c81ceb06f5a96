"""The CPU's cores split among the engines stepping at the same time (runner/cpu_budget.py): the table,
its sharing with an engine worker process through the inherited file descriptor, and the team size an
engine thread steps with while another engine is busy and once it is alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from gpuservd.engine.loop import EngineLoop, Submission
from gpuservd.engine.request import RequestOutput, SamplingParams
from gpuservd.runner.cpu_budget import SLOTS, CpuBudget
from gpuservd.runner.omp import DEFAULT_THREADS

from daemon_harness import DaemonProcess, make_home
from test_engine import make_engine
from test_stream_path import _RecordingLoop

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not CpuBudget.available(), reason="the budget's table needs memfd_create (Linux)")


def test_busy_engines_split_the_cores_and_one_alone_takes_them_all():
    b = CpuBudget(cores=4)
    a, c = b.seat("a"), b.seat("c")
    assert a.slot != c.slot
    assert a.enter() == 4  # alone
    assert c.enter() == 2  # both busy
    a.leave()
    assert c.enter() == 4  # alone again at its next step
    a.enter()
    assert b.busy() == 2
    b.release("a")  # unloaded (or its worker died) inside a step: no longer busy
    assert b.busy() == 1 and c.enter() == 4
    assert b.seat("a").slot == a.slot  # the slot is reused
    assert CpuBudget(cores=3).seat("x").enter() == 3
    b5 = CpuBudget(cores=5)
    seats = [b5.seat(str(i)) for i in range(3)]
    assert [s.enter() for s in seats] == [5, 2, 1]  # never below one thread
    b.close()
    b5.close()


def test_a_worker_process_shares_the_table_through_the_inherited_descriptor():
    b = CpuBudget(cores=2)
    mine, theirs = b.seat("daemon-thread"), b.seat("worker")
    code = ("import sys; from gpuservd.runner.cpu_budget import CpuBudget, BudgetSeat; "
            "fd, slot = int(sys.argv[1]), int(sys.argv[2]); "
            "s = BudgetSeat(CpuBudget(2, fd), slot); print(s.enter()); sys.stdout.flush(); sys.stdin.readline(); "
            "s.leave()")
    p = subprocess.Popen([sys.executable, "-c", code, str(b.fd), str(theirs.slot)], pass_fds=(b.fd,), cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "2"  # it stepped alone
        assert b.busy() == 1 and mine.enter() == 1  # the daemon's engine sees the worker's step
        mine.leave()
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.wait(30) == 0
        assert b.busy() == 0 and mine.enter() == 2
    finally:
        p.kill()
        b.close()


def test_an_engine_thread_steps_with_its_share_while_another_engine_steps(tiny_model_dir):
    """Without the budget the engine keeps one fixed team size through both phases."""
    budget = CpuBudget(cores=4)
    other = budget.seat("other")  # a second engine, inside a step for the whole first phase
    teams: list[tuple[int, int]] = []  # (phase, team size seen on the engine thread after each step)
    phase = [1]
    finished = {1: threading.Event(), 2: threading.Event()}

    class Hooks:
        def on_step(self, model, record, outputs):
            teams.append((phase[0], torch.get_num_threads()))

        def on_abort(self, model, output):
            pass

    class Sink:
        def __init__(self, n):
            self.n = n

        def put(self, item):
            if isinstance(item, RequestOutput) and item.finished:
                finished[self.n].set()

    loop = EngineLoop("tiny", lambda: make_engine(tiny_model_dir), _RecordingLoop(),
                      lambda d, e: [s.put(i) for s, i in d], hooks=Hooks(), seat=budget.seat("tiny"))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    other.enter()
    loop.submit(Submission("r1", [3, 4, 5, 6], params, Sink(1)))
    loop.start()
    try:
        assert finished[1].wait(120)
        phase[0] = 2
        other.leave()  # the other engine went idle
        loop.submit(Submission("r2", [3, 4, 5, 6], params, Sink(2)))
        assert finished[2].wait(120)
    finally:
        loop.stop()
        budget.close()
    first = {n for p, n in teams if p == 1}
    second = {n for p, n in teams if p == 2}
    assert first == {2} and second == {4}, teams


def _budget_table(pid: int):
    """The daemon's budget table, opened through its memfd in /proc (what its worker processes inherit)."""
    import mmap

    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "gpuserv-cpu-budget" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                with open(f"/proc/{pid}/fd/{fd}", "r+b") as f:
                    return mmap.mmap(f.fileno(), SLOTS)
        except OSError:
            continue
    raise AssertionError("the daemon holds no CPU budget table")


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="one core: every share is the whole machine")
def test_an_engine_worker_process_steps_with_its_share_of_the_daemons_budget(tmp_path, tiny_model_dir):
    """A worker's engine reads the daemon's table: with another engine marked busy its steps run on half
    the cores (its status reports the team of its last step), alone on all of them."""
    home = make_home(tmp_path, tiny_model_dir)
    config = {"engine": {"isolation": "process", "num_threads": None}}
    with DaemonProcess(tmp_path, home, config=config) as d, d.http() as c:
        table = _budget_table(d.proc.pid)

        def team_after_a_request() -> int:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return next(m for m in c.get("/admin/status").json()["models"] if m["name"] == "tiny")["decode"]["threads"]

        table[SLOTS - 1] = 1  # another engine inside a step
        assert team_after_a_request() == DEFAULT_THREADS // 2
        table[SLOTS - 1] = 0
        assert team_after_a_request() == DEFAULT_THREADS
        table.close()

"""Only the engine's thread owns an OpenMP team in the daemon (gpuservd/runner/omp.py).

libgomp stops spinning at its barriers once a process holds more team threads than CPUs, and torch resets
a thread's team size to a process-wide value the first time each of its libraries (our C++ kernels too)
runs a parallel loop on that thread. In the daemon the event loop and the executor threads set that value
to 1, so without a guard the engine's thread dropped to a team of one after its first step: steps took
1.6x as long through the socket as in-process. Checked in a fresh process, in the daemon's order.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpuservd.runner.omp import DEFAULT_THREADS

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import json, sys, threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gpuservd.config import EngineConfig
from gpuservd.engine.request import SamplingParams
from gpuservd.runner.omp import DEFAULT_THREADS, use_threads
from gpuservd.worker.build import make_engine

use_threads(1)  # the daemon's event-loop thread
torch.ones(1 << 16).add_(1)
built, go, out = threading.Event(), threading.Event(), {}

def engine_thread():
    eng = make_engine("tiny", Path(sys.argv[1]), EngineConfig(model="tiny"), None, None, None, None)
    out["after_build"] = torch.get_num_threads()
    built.set()
    go.wait()
    for i in range(4):
        eng.add_request(f"r{i}", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=6, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    out["after_steps"] = torch.get_num_threads()
    out["status"] = eng.decode_status()["threads"]

t = threading.Thread(target=engine_thread)
t.start()
built.wait()
io = ThreadPoolExecutor(1, initializer=use_threads, initargs=(1,))  # created after the build, as the daemon's
out["io"] = io.submit(lambda: (torch.ones(1 << 16).add_(1), torch.get_num_threads())[1]).result()
go.set()
t.join()
out["main"] = torch.get_num_threads()
out["default"] = DEFAULT_THREADS
print(json.dumps(out))
"""


@pytest.mark.skipif(DEFAULT_THREADS < 2, reason="one CPU: every thread runs alone anyway")
def test_only_the_engine_thread_keeps_a_team(tiny_model_dir):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], capture_output=True, text=True,
                       timeout=600, cwd=ROOT, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    n = got["default"]
    assert got["after_build"] == n and got["after_steps"] == n and got["status"] == n, got
    assert got["io"] == 1 and got["main"] == 1, got

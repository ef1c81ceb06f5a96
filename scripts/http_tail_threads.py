"""Who takes the cores while gpuserv streams a batch <= 8 tail through HTTP: per-thread CPU time and run-queue
wait (/proc/PID/task/TID/schedstat) of the private daemon and of this bench process, over the run.

The OpenMP workers run at SCHED_IDLE: any runnable normal thread (the event loop, the client, a sampler)
takes their core outright and the step waits at the next barrier. A worker's run-queue wait per step is
that cost; the normal threads' CPU per step is what caused it.

    PYTHONPATH=$PWD .venv/bin/python scripts/http_tail_threads.py [STREAMS=8] [TOKENS=256]
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from gpuservd.bench.gpuserv_http import run_gpuserv_http
from gpuservd.bench.proc_tree import tree_pids
from gpuservd.bench.workload import WorkloadRequest


def threads(pid: int) -> dict:
    """{(pid, tid): (name, ns on a CPU, ns waiting on a run queue, time slices)} for pid's threads."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            run_ns, wait_ns, slices = map(int, Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split())
        except OSError:
            continue  # exited
        out[(pid, int(tid))] = (name, run_ns, wait_ns, slices)
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    reqs = [WorkloadRequest(f"r{i}", "long", 0.0, [100 + (i * 7 + j) % 500 for j in range(32)], tokens,
                            model="smollm2") for i in range(n)]
    snaps: list[tuple[float, dict]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.25):
            snap = {}
            for pid in tree_pids(os.getpid()):
                try:
                    snap.update(threads(pid))
                except OSError:
                    pass
            snaps.append((time.perf_counter(), snap))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    run = run_gpuserv_http(Path("profiles/engine/peers-48.yaml"), "smollm2", reqs, 2, "float32",
                           Path("bench/runs/http-tail-threads"))
    stop.set()
    sampler.join()
    steps = max(t.output_tokens for t in run.requests)
    print(f"{n} streams x {tokens} tokens: wall {run.wall_s:.1f} s, ~{steps} steps, "
          f"{1000 * run.wall_s / steps:.1f} ms a step")
    # The window: from the run's start to its last response, the daemon's start-up and stop left out (the
    # last snapshot that still sees all the daemon's threads ends it).
    daemon_size = max(len(s) for _, s in snaps)
    end_t, last = next((t, s) for t, s in reversed(snaps) if len(s) == daemon_size)
    t0, first = min(((t, s) for t, s in snaps if t >= end_t - run.wall_s), key=lambda ts: ts[0])
    print(f"window {end_t - t0:.1f} s of the run's {run.wall_s:.1f} s")
    rows = []
    for k, (name, r1, w1, s1) in last.items():
        if k not in first:
            continue
        _, r0, w0, s0 = first[k]
        if r1 - r0 > 1e6 or w1 - w0 > 1e6:
            rows.append((k, name, (r1 - r0) / 1e6, (w1 - w0) / 1e6, s1 - s0))
    print("    pid     tid name             CPU ms  ms/step  run-queue ms  ms/step  slices")
    for (pid, tid), name, run_ms, wait_ms, slices in sorted(rows, key=lambda r: -r[2]):
        print(f"{pid:7} {tid:7} {name:14} {run_ms:9.1f} {run_ms / steps:8.2f} {wait_ms:12.1f} "
              f"{wait_ms / steps:8.2f} {slices:7}")


if __name__ == "__main__":
    main()

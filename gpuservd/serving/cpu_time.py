"""CPU time the daemon has spent, split by who spent it (GET /admin/status `process`).

The benchmarks divide the difference of two readings by the tokens streamed
between them: CPU seconds per streamed token stays meaningful on a machine
that other work shares, where wall-clock times do not.

- `cpu_s`: this process, every thread (the engine threads, their math
  libraries' worker threads, the event loop, helper threads);
- `loop_cpu_s`: the event loop's thread alone: HTTP parsing, admission, SSE
  framing and writing, /metrics rendering, the periodic checks; the part of the
  daemon that is the serving path rather than the engine;
- `workers_cpu_s`: engine worker processes (engine.isolation: process), which
  `cpu_s` does not include;
- `gil_switch_interval_s`: how long a thread may hold the GIL while the event
  loop waits for it (Python's default of 5 ms unless something changed it).
"""

from __future__ import annotations

import sys
import time

import psutil


def cpu_reading(worker_pids=()) -> dict:
    """Call on the event loop's thread (the admin routes and the hint monitor run there)."""
    workers = 0.0
    for pid in worker_pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:  # exited between the listing and the reading: its time is gone with it
            continue
        workers += t.user + t.system
    return {"cpu_s": round(time.process_time(), 4), "loop_cpu_s": round(time.thread_time(), 4),
            "workers_cpu_s": round(workers, 4), "gil_switch_interval_s": sys.getswitchinterval()}

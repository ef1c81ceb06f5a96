"""Which threads of a process own an OpenMP team for torch's CPU ops.

torch runs a CPU op's parallel loops on the calling thread's OpenMP team. libgomp (the OpenMP of torch's
Linux wheels) gives every thread that runs a parallel region a team of its own and keeps it while that
thread lives. Once a process holds more such team threads than it has CPUs, libgomp stops spinning at
its barriers (about 100 spins instead of about 3 ms) and every barrier of every op becomes a futex sleep
and a wake-up. In the daemon, one tensor op on the event-loop thread or on an executor thread (the
host-tier copy after a load) was enough: on a 2-core machine the engine's decode steps then took 1.8x as
long while its two threads used one core between them.

So a thread that runs an engine takes a team of the engine's size (`use_threads(n)`), and every other
thread of the daemon that may touch a tensor runs its ops on itself alone (`use_threads(1)`).
"""

from __future__ import annotations

import os
import threading

import torch

from gpuservd.errors import UserError

# torch's own choice for this process (OMP_NUM_THREADS, else its count of cores), read once at import,
# before any thread of ours has set a count: torch.set_num_threads also changes the value later threads
# start from.
DEFAULT_THREADS = torch.get_num_threads()


def use_threads(n: int | None) -> int:
    """Run this thread's tensor ops on a team of n threads (None: torch's default); returns n.

    A thread's first op sets its count from the process-wide value torch keeps (the last count any
    thread set); reading the count first makes that happen now, so the count set here is the one
    that stays."""
    n = n or DEFAULT_THREADS
    torch.get_num_threads()
    torch.set_num_threads(n)
    return n


# GPUSERV_OMP_WORKER_PRIORITY can run the OpenMP pool's worker threads at a lower CPU priority than the
# daemon's Python threads: a nice value 1-19, or "idle" for Linux's SCHED_IDLE policy (0, the default, leaves
# them as they are). Lowered, a worker is preempted when the event loop's thread wakes on a machine whose
# cores the engines' teams fill, instead of the loop waiting for a team thread's time slice to end; a
# SCHED_IDLE one also leaves its core counted as idle when the kernel picks a core for the waking thread.
# Only the pool's workers are lowered: the engine's own thread runs Python and holds the GIL between ops.
# It is off by default because a lowered worker starves as soon as anything else wants the cores: the
# process's share drops under one core per team thread, the engine thread (normal priority) spins at every
# op's barrier for a worker that gets almost none of that share, and each op waits for it. One engine
# decoding 48 rows, the policy alternated every 8 steps on a loaded 2-core machine: 1.47 s a step with
# the workers at normal priority, 14.2 s with them under SCHED_IDLE (8 rows: 0.60 s against 7.7 s;
# medians over 4 rounds). The in-process engine never lowers its pool, so the daemon then fell to a few
# percent of its throughput.
# Set it only where the engines have the cores to themselves.
WORKER_PRIORITY_ENV = "GPUSERV_OMP_WORKER_PRIORITY"
IDLE = "idle"
DEFAULT_WORKER_PRIORITY = 0


def worker_priority() -> int | str:
    """The workers' nice value, or "idle". The daemon reads it at start, so a bad value stops it there."""
    raw = os.environ.get(WORKER_PRIORITY_ENV, "").strip().lower() or str(DEFAULT_WORKER_PRIORITY)
    if raw == IDLE:
        return IDLE if hasattr(os, "SCHED_IDLE") else 19
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"{WORKER_PRIORITY_ENV} must be a nice value 0-19 or 'idle', got {raw!r}") from None
    if not 0 <= value <= 19:
        raise UserError(f"{WORKER_PRIORITY_ENV} must be a nice value 0-19 or 'idle', got {value}")
    return value


def _lower(tid: int, priority: int | str) -> bool:
    """Lower one thread (a thread id: Linux applies both calls to that thread alone); False if it already was."""
    if priority == IDLE:
        if os.sched_getscheduler(tid) == os.SCHED_IDLE:
            return False
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return True
    if os.getpriority(os.PRIO_PROCESS, tid) >= priority:
        return False
    os.setpriority(os.PRIO_PROCESS, tid, priority)
    return True


def demote_pool_workers(priority: int | str) -> list[int] | None:
    """Lower this process's threads that Python does not run (libgomp's team workers; also any other
    native pool's threads, which hold no GIL either) to `priority`; returns the thread ids changed, or
    None when a Python thread was starting (its id not known yet: try again later). Python's threads,
    the engine's among them, keep theirs."""
    if not priority or not os.path.isdir("/proc/self/task"):
        return []
    tids = [int(entry) for entry in os.listdir("/proc/self/task")]
    # listed first: a Python thread started before the listing is known to threading by now, with its id
    # or (still starting) without one
    python_threads = {t.native_id for t in threading.enumerate()}
    if None in python_threads:
        return None
    python_threads.add(threading.get_native_id())
    changed = []
    for tid in tids:
        if tid in python_threads:
            continue
        try:
            if _lower(tid, priority):
                changed.append(tid)
        except OSError:  # the thread exited since the listing
            continue
    return changed


class PoolPriority:
    """The process's OpenMP workers lowered after the step that created them.

    libgomp creates a thread's workers at its first parallel region with a given team size and keeps them
    while the thread lives: the process is swept after a step whenever its thread count has changed since
    the last sweep (one directory listing a step otherwise)."""

    def __init__(self, priority: int | str | None = None):
        self.priority = worker_priority() if priority is None else priority
        self._threads = 0

    def after_step(self) -> None:
        if not self.priority:
            return
        try:
            n = len(os.listdir("/proc/self/task"))
        except OSError:  # no /proc: nothing to lower
            self.priority = 0
            return
        if n != self._threads and demote_pool_workers(self.priority) is not None:
            self._threads = n

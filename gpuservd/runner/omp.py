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

import torch

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

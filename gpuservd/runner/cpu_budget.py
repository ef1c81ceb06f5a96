"""The CPU's cores shared among the engines that step at the same time.

Each engine runs its tensor ops on an OpenMP team of its own (runner/omp.py), by default as large as
the machine. Two engines that step at once (engine worker processes, or engine threads without the
sharing arbiter's time slices) then run twice as many busy threads as there are cores: their spinning
workers wait on each other's preempted threads at every barrier. Measured on a 2-core VM, two SmolLM2
worker processes with 4 streams: 14 tokens/s with teams of 2 against 58 tokens/s with teams of 1.
A fixed team of cores / models would instead leave an engine half the machine while the other idles.

So the engines that step at a given moment split the cores: before each step an engine marks itself
busy in a table shared by the daemon's engine threads and its worker processes, and takes
max(1, cores // busy engines) threads for that step; after the step it clears its mark. An engine
alone gets the whole machine at its next step. The table is one byte per engine in a shared memory
file (memfd) that the daemon creates and hands to each worker process by file descriptor.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref

from gpuservd.runner.omp import DEFAULT_THREADS

SLOTS = 256  # engines that can share one budget (a slot per loaded CPU model)


class CpuBudget:
    """The busy table; `cores` is what the engines split (torch's default team size: OMP_NUM_THREADS
    or the machine's cores). `fd`: a worker process's handle on the daemon's table."""

    def __init__(self, cores: int = DEFAULT_THREADS, fd: int | None = None):
        self.cores = max(1, cores)
        self._closer = None
        if fd is None and self.available():  # the daemon's: a fresh table the worker processes it starts inherit
            fd = os.memfd_create("gpuserv-cpu-budget", 0)
            self._closer = weakref.finalize(self, os.close, fd)  # a budget dropped unclosed leaks no descriptor
            os.ftruncate(fd, SLOTS)
        self.fd = fd  # None without memfd_create: the daemon's engine threads share the table, workers cannot
        self._table = mmap.mmap(-1 if fd is None else fd, SLOTS)
        self._free = list(range(SLOTS - 1, -1, -1))  # the daemon's bookkeeping: unused slots, and whose
        self._slots: dict[str, int] = {}
        self._lock = threading.Lock()

    @staticmethod
    def available() -> bool:
        return hasattr(os, "memfd_create")

    # ---- the daemon: one slot per model's engine --------------------------------------------------
    def seat_for(self, model: str, device: str, fixed_threads: int | None) -> "BudgetSeat | None":
        """The model's seat when its engine runs on the CPU with torch's default team; None for another
        device, or when engine.num_threads fixes the team."""
        return self.seat(model) if str(device).startswith("cpu") and not fixed_threads else None

    def seat(self, model: str) -> "BudgetSeat":
        """A place for the model's engine (a fresh one: a model loaded again gets its old slot cleared)."""
        with self._lock:
            slot = self._slots.get(model)
            if slot is None:
                if not self._free:
                    raise RuntimeError(f"more than {SLOTS} engines share the CPU budget")
                slot = self._slots[model] = self._free.pop()
        self._table[slot] = 0
        return BudgetSeat(self, slot)

    def release(self, model: str) -> None:
        """The model's engine is gone (unloaded, or its worker process exited, maybe inside a step): it no
        longer counts as busy, and its slot is free for another model."""
        with self._lock:
            slot = self._slots.pop(model, None)
            if slot is None:
                return
            self._free.append(slot)
        self._table[slot] = 0

    # ---- an engine, around each step --------------------------------------------------------------
    def enter(self, slot: int) -> int:
        """Mark the engine busy; the team size for its step."""
        self._table[slot] = 1
        return max(1, self.cores // max(1, self.busy()))

    def leave(self, slot: int) -> None:
        self._table[slot] = 0

    def busy(self) -> int:
        return self._table[:SLOTS].count(1)

    def close(self) -> None:
        """The daemon's end of the table (a worker's handle closes with its process)."""
        self._table.close()
        if self._closer is not None:
            self._closer()


class BudgetSeat:
    """One engine's place in a budget: what its step loop calls."""

    def __init__(self, budget: CpuBudget, slot: int):
        self.budget = budget
        self.slot = slot

    def enter(self) -> int:
        return self.budget.enter(self.slot)

    def leave(self) -> None:
        self.budget.leave(self.slot)

    def handover(self) -> tuple[int, int, int] | None:
        """(fd, slot, cores) for an engine worker process (WorkerSpec.cpu_budget); None when the table
        cannot be shared with another process."""
        return None if self.budget.fd is None else (self.budget.fd, self.slot, self.budget.cores)

"""A short CPU time slice for the event loop's thread, so that it gets a core as soon as it wakes.

On a CPU-only box the engine threads keep every core busy while they step. The event loop's thread wakes
(a scrape, a request, a token to write) and must take a core from one of them. Linux's scheduler (EEVDF,
6.6 and later) lets the running thread finish its protected slice first, about 0.75 ms times
1 + log2(cores), unless the woken thread asks for a shorter slice (`sched_setattr` with `sched_runtime`,
Linux 6.12 and later, no privilege needed): its deadline is then earlier and it preempts at once. It
gets no more CPU than before over time, only sooner; the engine threads lose a few microseconds at each of
the loop's wake-ups instead of the loop waiting up to a slice for each.

GPUSERV_LOOP_SLICE_US sets it (default 100, the kernel's floor; 0 leaves the thread as it is). An older
kernel or another OS keeps its default silently: it is a latency aid, not something to fail a start for.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct

from gpuservd.errors import UserError

SLICE_ENV = "GPUSERV_LOOP_SLICE_US"
DEFAULT_SLICE_US = 100
MIN_SLICE_US, MAX_SLICE_US = 100, 100_000  # what the kernel accepts (it clamps to this range)
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}  # (sched_setattr, sched_getattr)
# struct sched_attr as of Linux 5.3: size, policy, flags, nice, priority, runtime, deadline, period, util min/max
_ATTR = struct.Struct("IIQiIQQQII")
_NORMAL = 0  # SCHED_OTHER


def slice_us() -> int:
    """The configured slice in microseconds (0: none). The daemon reads it at start, so a bad value stops it."""
    raw = os.environ.get(SLICE_ENV, "").strip() or str(DEFAULT_SLICE_US)
    try:
        value = int(raw)
    except ValueError:
        raise UserError(f"{SLICE_ENV} must be 0 or a whole number of microseconds {MIN_SLICE_US}-{MAX_SLICE_US}, "
                        f"got {raw!r}") from None
    if value and not MIN_SLICE_US <= value <= MAX_SLICE_US:
        raise UserError(f"{SLICE_ENV} must be 0 or {MIN_SLICE_US}-{MAX_SLICE_US} microseconds, got {value}")
    return value


def _syscall(nr: int, *args) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(nr), *args) == 0:
        return 0
    return ctypes.get_errno() or -1


def thread_slice_ns(tid: int = 0) -> int | None:
    """The thread's slice in ns (the kernel's base slice unless one was asked for; 0 before Linux 6.12), None
    where it cannot be read."""
    nrs = _SYSCALLS.get(platform.machine())
    if nrs is None or not hasattr(os, "sched_getscheduler"):
        return None
    buf = ctypes.create_string_buffer(_ATTR.size)
    if _syscall(nrs[1], ctypes.c_int(tid), buf, ctypes.c_uint(_ATTR.size), ctypes.c_uint(0)):
        return None
    fields = _ATTR.unpack(buf.raw)
    return fields[5] if fields[1] == _NORMAL else None


def shorten_slice(us: int | None = None, tid: int = 0) -> bool:
    """Ask for a slice of `us` microseconds (None: GPUSERV_LOOP_SLICE_US) for thread `tid` (0: this one),
    keeping its policy and nice value; True if the kernel took it."""
    us = slice_us() if us is None else us
    nrs = _SYSCALLS.get(platform.machine())
    if not us or nrs is None or not hasattr(os, "getpriority") or os.sched_getscheduler(tid) != _NORMAL:
        return False
    nice = os.getpriority(os.PRIO_PROCESS, tid)  # sched_setattr sets the nice value too: keep it
    attr = ctypes.create_string_buffer(_ATTR.pack(_ATTR.size, _NORMAL, 0, nice, 0, us * 1000, 0, 0, 0, 0))
    if _syscall(nrs[0], ctypes.c_int(tid), attr, ctypes.c_uint(0)):
        return False  # e.g. a seccomp filter (a kernel before 6.12 takes the call and ignores the runtime)
    return thread_slice_ns(tid) == us * 1000

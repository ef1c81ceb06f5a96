"""The event loop thread's short scheduler slice (gpuservd/daemon/loop_slice.py): the setting is checked, the
slice is set on the thread asked for and nowhere else, its nice value stays, and the daemon's event loop
thread has it (tests/test_observability.py's daemon: a real daemon process)."""

from __future__ import annotations

import os
import threading

import pytest

from gpuservd.daemon.loop_slice import SLICE_ENV, shorten_slice, slice_us, thread_slice_ns
from gpuservd.errors import UserError


def kernel_slices() -> bool:
    """Does this kernel keep a custom slice for a normal thread (Linux 6.12+)? Asked on a thread of its own."""
    out = []
    t = threading.Thread(target=lambda: out.append(shorten_slice(200)))
    t.start()
    t.join()
    return out == [True]


needs_slices = pytest.mark.skipif(not kernel_slices(), reason="this kernel keeps no custom slice for a normal "
                                  "thread (sched_setattr's runtime for SCHED_OTHER: Linux 6.12 and later)")


def test_the_setting_is_checked(monkeypatch):
    monkeypatch.delenv(SLICE_ENV, raising=False)
    assert slice_us() == 100
    monkeypatch.setenv(SLICE_ENV, "0")
    assert slice_us() == 0 and shorten_slice() is False
    for bad in ("fast", "50", "200000", "-1"):
        monkeypatch.setenv(SLICE_ENV, bad)
        with pytest.raises(UserError, match=SLICE_ENV):
            slice_us()


@needs_slices
def test_the_slice_is_set_on_that_thread_alone_and_its_nice_value_stays():
    seen = {}

    def run():
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 3)  # raising one's own nice value needs no privilege
        seen["before"] = thread_slice_ns()
        seen["took"] = shorten_slice(150)
        seen["after"], seen["nice"] = thread_slice_ns(), os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    default = seen.pop("before")  # the kernel's base slice
    assert default != 150_000 and seen == {"took": True, "after": 150_000, "nice": 3}
    assert thread_slice_ns() == default  # the test's own thread kept the kernel's default

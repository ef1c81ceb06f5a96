"""Memory and CPU of a server's whole process tree, sampled from /proc while a benchmark runs.

A server is often several processes (vLLM's API server and its engine core,
gpuserv's engine workers), so the root process and every descendant are summed.
Resident set sizes are added up as the kernel reports them: pages shared
between the processes count once per process, which overstates a multi-process
server a little (the report says "RSS of the process tree"). CPU seconds are the
tree's utime + stime; the difference between `start()` and `stop()` is what the
server spent on the run. The root process's own share is kept apart (`front_cpu_*`): for gpuserv with
its engine in a worker process, the daemon's serving path (HTTP, SSE framing, admission) without the
engine's math; for vLLM its API server without the engine core.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _children(pid: int) -> list[int] | None:
    """pid's child processes from /proc/PID/task/*/children (each thread lists the children it forked);
    None where the kernel has no such file (built without CONFIG_PROC_CHILDREN)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []  # exited
    out: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread exited
            return None
        except OSError:
            continue
    return out


def tree_pids(root: int) -> list[int]:
    """`root` and all its live descendants. Walks the children files from the root down (a few reads for a
    server's handful of processes); scans every process in /proc only where the kernel lacks them: a
    sampler runs this 4 times a second beside the servers it measures, on their cores."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        kids = _children(pid)
        if kids is None:
            return _tree_pids_by_scan(root)
        out.append(pid)
        todo.extend(kids)
    return out


def _tree_pids_by_scan(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields:  # fields[1] is the parent pid (field 4 of stat)
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def rss_bytes(pids) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
        except (OSError, IndexError, ValueError):
            pass  # exited between the scan and the read
    return total


def cpu_seconds(pids) -> float:
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:  # utime and stime are stat fields 14 and 15
            ticks += int(fields[11]) + int(fields[12])
    return ticks / TICK


class TreeSampler:
    """Samples the tree under `root` every `interval_s` on a thread; keeps the peak RSS."""

    def __init__(self, root: int, interval_s: float = 0.25):
        self.root = root
        self.interval_s = interval_s
        self.peak_rss = 0
        self.samples = 0
        self.cpu_s = 0.0  # tree CPU seconds between start() and stop()
        self.front_cpu_s = 0.0  # the root process's own share of them
        self._cpu0 = self._front0 = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def _sample(self) -> list[int]:
        pids = tree_pids(self.root)
        self.peak_rss = max(self.peak_rss, rss_bytes(pids))
        self.samples += 1
        return pids

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> "TreeSampler":
        self._cpu0 = cpu_seconds(self._sample())
        self._front0 = cpu_seconds([self.root])
        self._thread.start()
        return self

    def stop(self) -> "TreeSampler":
        self._stop.set()
        self._thread.join()
        self.cpu_s = cpu_seconds(self._sample()) - self._cpu0
        self.front_cpu_s = cpu_seconds([self.root]) - self._front0
        return self

    def summary(self, tokens: int) -> dict:
        return {"peak_rss_bytes": self.peak_rss, "peak_rss_mib": round(self.peak_rss / 2**20, 1),
                "rss_samples": self.samples, "server_cpu_s": round(self.cpu_s, 3),
                "server_cpu_ms_per_token": round(1000 * self.cpu_s / tokens, 3) if tokens else None,
                "front_cpu_s": round(self.front_cpu_s, 3),
                "front_cpu_ms_per_token": round(1000 * self.front_cpu_s / tokens, 4) if tokens else None}

"""CUDA MPS: detect a running control daemon, and the environment of an engine worker process under it.

MPS partitions SMs between processes (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) and caps
each one's device memory (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT). It only acts on
separate client processes, and reads both variables when the process creates its
CUDA context: so under the mps backend every model's engine runs in a worker
process of its own (gpuservd/worker/), started with `worker_env(...)` in its
environment (gpu/backends.py MpsBackend.worker_env adds the one GPU it sees).
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import psutil

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
CONTROL_NAME = "nvidia-cuda-mps-control"
MIB = 2**20


@dataclass
class MpsDaemon:
    """What was found of a running MPS control daemon."""

    found: bool
    pipe_directory: str  # where clients find it (CUDA_MPS_PIPE_DIRECTORY or the default)
    how: str  # "control pipe" | "process <pid>" | why it was not found


def detect_mps(env: dict | None = None, process_names=None) -> MpsDaemon:
    """Look for the control daemon's pipe (`<pipe dir>/control`, a FIFO), then for its process.

    `process_names` (an iterable of (pid, name)) is for tests; by default psutil lists the processes."""
    env = os.environ if env is None else env
    pipe_dir = env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY
    control = Path(pipe_dir) / "control"
    try:
        if stat.S_ISFIFO(control.stat().st_mode):
            return MpsDaemon(True, pipe_dir, f"control pipe {control}")
    except OSError:
        pass
    if process_names is None:
        try:
            process_names = ((p.info["pid"], p.info["name"]) for p in psutil.process_iter(["pid", "name"]))
        except Exception:
            process_names = ()
    for pid, name in process_names:
        if name == CONTROL_NAME:
            # it runs, but its pipe is elsewhere: clients must be told where (CUDA_MPS_PIPE_DIRECTORY)
            return MpsDaemon(True, pipe_dir, f"process {pid} ({CONTROL_NAME}); no control pipe at {control}")
    return MpsDaemon(False, pipe_dir, f"no MPS control daemon (no pipe at {control}, no {CONTROL_NAME} process)")


def active_thread_percentage(num_sms: int, num_sms_total: int) -> int:
    """The percentage that gives at least `num_sms` of `num_sms_total` SMs (rounded up, 1..100).

    MPS turns the percentage back into an SM count itself (in its own granule), so the count a worker
    gets can differ from the plan by a TPC; gpu_check measures it."""
    if num_sms_total <= 0 or num_sms <= 0:
        raise ValueError(f"num_sms ({num_sms}) and num_sms_total ({num_sms_total}) must be > 0")
    return max(1, min(100, math.ceil(100 * num_sms / num_sms_total - 1e-9)))


def worker_env(num_sms: int, num_sms_total: int, quota_bytes: int | None, device_index: int = 0,
               pipe_directory: str | None = None) -> dict[str, str]:
    """Environment variables for one engine worker process under MPS.

    `device_index` is the device as the worker sees it (0 when its CUDA_VISIBLE_DEVICES names one GPU);
    MPS takes the memory limit per index ("0=25600M")."""
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(active_thread_percentage(num_sms, num_sms_total))}
    if quota_bytes is not None:
        if quota_bytes <= 0:
            raise ValueError(f"quota_bytes must be > 0, got {quota_bytes}")
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"{device_index}={math.ceil(quota_bytes / MIB)}M"
    if pipe_directory:
        env["CUDA_MPS_PIPE_DIRECTORY"] = pipe_directory
    return env

"""A model's engine worker process as the model manager sees it: start, ready, exit.

`engine.isolation: process` (and the MPS backend, always) runs a model's engine
in a worker process behind a WorkerLoop (worker/proxy.py). These are the model
manager's (models.py) steps around it: the loop with the environment
the partition backend gives the worker, what happens once its engine is built,
and the model failing when the process exits unasked.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from gpuservd.engine.calls import EngineFacts, set_kv_limit
from gpuservd.events.types import EngineWorkerExit
from gpuservd.serving.request_stream import ModelSlot
from gpuservd.runner.model_config import load_arch
from gpuservd.worker.build import WorkerSpec
from gpuservd.worker.proxy import WorkerLoop, worker_environment
from gpuservd.worker.spare import SpareWorker

if TYPE_CHECKING:  # the manager imports this module; only its type is needed here
    from gpuservd.serving.models import Models

log = logging.getLogger("gpuservd.serving.models")


def worker_loop(models: "Models", slot: ModelSlot, cfg, model_dir: Path, on_layer, seat=None) -> WorkerLoop:
    """A WorkerLoop for the slot's model: its engine in a worker process, with the environment the
    partition backend gives it (MPS: its SM percentage and memory limit) and its seat in the daemon's
    CPU budget (runner/cpu_budget.py), if it has one."""
    env = models.sharing.worker_env(slot.name)
    wcfg = copy.deepcopy(cfg)
    if "CUDA_VISIBLE_DEVICES" in env:  # the worker sees its one GPU as device 0
        wcfg.device = "cuda:0"
    slot.num_layers = load_arch(model_dir).num_layers
    cc, srv = models.config.cache, models.config.server
    spec = WorkerSpec(slot.name, str(model_dir), str(model_dir), wcfg, models.sources.compression_for(slot.name),
                      cc.initial_layers if cc.load_strategy == "layered" else None, models.quotas,
                      srv.admission_window_ms / 1000, srv.log_level,
                      seat.handover() if seat is not None else None)
    return WorkerLoop(slot.name, spec, asyncio.get_running_loop(), models.on_post, models.metrics, env, on_layer,
                      partial(worker_exited, models), spare=models.spare)


def spare_worker(models: "Models") -> SpareWorker | None:
    """A SpareWorker (worker/spare.py) where a model may go to a worker with no settings of its own: a CPU
    device that engine.isolation (auto or process) sends to workers, not under MPS (its workers' settings
    are their environment); started now, beside the daemon's own start-up. None elsewhere."""
    if models.sharing.backend.name == "mps" or not any(
            d.startswith("cpu") and models.sharing.isolation(models.config.engine.isolation, d) == "process"
            for d in models.devices):
        return None
    fd = models.cpu_budget.fd
    spare = SpareWorker(worker_environment(), (fd,) if fd is not None else ())
    spare.ensure()
    return spare


def replenish_spare(models: "Models", loop=None) -> None:
    """A worker's model left (unloaded, or its worker exited): a load is likely next; have a spare ready.
    `loop`: the model's engine loop (nothing to do for an engine thread's)."""
    if models.spare is not None and (loop is None or loop.isolation == "process"):
        asyncio.get_running_loop().run_in_executor(None, models.spare.ensure)


async def worker_ready(models: "Models", slot: ModelSlot, loop: WorkerLoop, facts: EngineFacts) -> None:
    """A worker's engine is built: its memory quota caps its KV pool, the store bytes it read count."""
    models.sharing.worker_started(slot.name, loop.pid)
    cap = models.sharing.pool_loaded(slot.name, facts.bytes_per_block, facts.num_kv_blocks,
                                     lambda: loop.snapshot.kv_blocks_used)
    if cap is not None:
        await asyncio.wrap_future(loop.call(partial(set_kv_limit, cap)))
    slot.source_tier = facts.source_tier
    models.cache.bytes_loaded["disk"] += facts.bytes_read
    if models.cpu_budget.fd is None:  # no budget shared with workers (no memfd): their teams stay fixed
        warn_cpu_oversubscription(models.slots.values(), slot)


def warn_cpu_oversubscription(slots, slot: ModelSlot) -> None:
    """Workers on a CPU run side by side (the arbiter paces engine threads only), each with torch's
    default of every core unless engine.num_threads is set: two busy workers then fight over the
    cores with spinning OpenMP pools. Said once per load, in the log, with the fix, where the daemon
    cannot share its CPU budget (runner/cpu_budget.py) with its workers."""
    if not slot.device.startswith("cpu") or slot.config.num_threads:
        return
    others = [s.name for s in slots if s is not slot and s.device == slot.device
              and s.loop is not None and getattr(s.loop, "pid", None) and not s.config.num_threads]
    if others:
        cores = os.cpu_count() or 1
        log.warning("models %s run in engine worker processes on %s, each with all %d cores: busy together "
                    "they oversubscribe the CPU; set engine.num_threads (e.g. %d) or use engine.isolation: "
                    "thread", ", ".join(sorted(others + [slot.name])), slot.device, cores,
                    max(1, cores // (len(others) + 1)))


def worker_exited(models: "Models", loop: WorkerLoop, info: dict) -> None:
    """On the event loop: a model's engine worker process exited unasked (its requests got 503s). The model
    is failed with the reason; the next request for it (or a load) starts a fresh worker."""
    slot = models.slots.get(loop.model)
    if slot is None or slot.loop is not loop:
        return  # it was unloaded or replaced meanwhile
    slot.state = "failed"
    slot.error = f"its engine worker process {info['pid']} exited ({info['reason']})"
    slot.worker_exit = info
    slot.loop = None
    slot.loaded.set()
    slot.encoder.shutdown(wait=False)
    models.sharing.detach(slot.name)
    models.cpu_budget.release(slot.name)  # it may have died inside a step: it no longer counts as busy
    models.cache.device_evicted(slot.name)
    replenish_spare(models)
    log.error("model %s failed: %s; %d requests failed", slot.name, slot.error, info["num_failed_requests"])
    models.bus.publish(EngineWorkerExit(model=slot.name, state="failed", device=slot.device or None, **info))

"""Building one model's engine over a weight source chosen by weights/sources.py.

Shared by both ways the daemon hosts an engine: an engine thread of its own
process (serving/models.py builds there, with the weight cache's in-memory tiers in
front) and an engine worker process (worker/__main__.py builds from a
`WorkerSpec`, reading the store: its process cannot see the daemon's memory).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.runner.omp import DEFAULT_THREADS


@dataclass
class WorkerSpec:
    """Everything a worker process needs to build and run one model's engine (sent pickled at start)."""

    model: str
    model_dir: str  # the store directory with its weights
    config_dir: str  # its config.json and tokenizer (the same directory for a full model)
    engine: EngineConfig  # its engine settings (device as the worker sees it)
    compression: str = "none"  # cache.compression: int8 reads (and first writes) the store's INT8 file
    initial_layers: int | None = None  # layered loading: serve after these many layers
    tenant_quotas: Any = None  # name -> TenantQuota
    admission_window_s: float = 0.0  # server.admission_window_ms, in seconds
    log_level: str = "info"
    # (fd, slot, cores) of the daemon's runner.cpu_budget.CpuBudget, its file descriptor handed over at the
    # start: the worker's engine takes its share of the cores per step; None = its own fixed team
    cpu_budget: tuple[int, int, int] | None = None


def make_engine(name: str, config_dir: Path, cfg: EngineConfig, source, initial_layers: int | None,
                on_layer, tenant_quotas):
    """The engine over `source`, with its tenants' quotas (on the thread that will step it, which takes the
    OpenMP team of the engine's size: runner/omp.py)."""
    if not cfg.num_threads:
        cfg = replace(cfg, num_threads=DEFAULT_THREADS)
    if cfg.device.startswith("cuda"):  # this thread's current device: streams and kernels go there

        torch.cuda.set_device(torch.device(cfg.device))
    engine = LLMEngine(name, Path(config_dir), cfg, weight_source=source, initial_layers=initial_layers,
                       on_layer=on_layer)
    if tenant_quotas is not None:
        engine.set_tenant_quotas(tenant_quotas)
    return engine

"""What GET /admin/status returns, as dataclasses the CLI and the console read (no torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelStatus:
    """One model as /admin/status reports it."""

    name: str
    state: str  # loading | ready | unloading | failed
    pinned: bool  # pinned models are never unloaded (nor evicted)
    device: str  # cpu | cuda:N
    kv_blocks_total: int
    kv_blocks_free: int
    kv_block_size: int  # tokens per block
    num_running: int  # in the engine's batch
    num_waiting: int  # in the engine's queue
    num_in_flight: int  # admitted by the API and not yet answered
    max_model_len: int  # context length
    num_steps: int  # engine steps so far
    error: str | None = None  # why it failed (state == failed)
    preemption: dict | None = None  # mode, enabled, granularity, kind, policy, host pool, swapped, costs
    decode: dict | None = None  # path (cuda_graphs | fixed_shape_eager | eager), reason, kernels, buckets captured
    prefix_cache: dict | None = None  # enabled, query_tokens, hit_tokens, hit_rate, cached_blocks, resets
    tiers: dict | None = None  # weight bytes per tier: {"device", "host", "host_compression"}
    weights_bytes: int = 0  # on the device, in the compute dtype
    num_layers: int = 0
    layers_ready: int = 0  # a layered load serves before this reaches num_layers
    source_tier: str = ""  # where its weights were loaded from: host | disk | disk-int8
    compression: str = "none"  # what its host and disk tiers hold: none | int8
    compression_refused: str | None = None  # why int8 was refused for it (its agreement numbers)
    keep_alive_s: float = -1.0  # how long it stays on the device idle (a request's keep_alive, else the config's)
    unload_in_s: float | None = None  # idle: seconds until it leaves the device by itself (None: it will not)
    sharing_class: str = "best_effort"  # latency_critical | best_effort (sharing.models)
    sharing_group: str = ""  # its SM group; "device" when the whole device is time-sliced
    num_sms: int | None = None  # SMs of its partition (an enforcing backend only)
    isolation: str = "thread"  # thread (an engine thread of the daemon) | process (an engine worker process)
    worker_pid: int | None = None  # its engine worker process (isolation process; None while it starts)
    worker_env: dict | None = None  # what the backend put in the worker's environment (MPS settings)


@dataclass
class DaemonStatus:
    """GET /admin/status."""

    version: str
    pid: int
    uptime_s: float
    state: str  # starting | serving | draining
    device: dict  # {"backend": "cpu" | "cuda", "name": ..., ...}
    socket: str | None  # Unix socket path
    tcp: str | None  # host:port when TCP is on
    models: list[ModelStatus]
    num_in_flight: int  # over all models
    num_requests_total: int  # admitted since start
    num_rejected_total: int  # refused with 4xx/5xx since start
    sharing: dict | None = None  # the SM-partition backend: {"name", "enforced", "summary", ...}
    arbiter: dict | None = None  # time slices and bandwidth priority (sharing/arbiter.py status())
    devices: dict | None = None  # per device: budget_bytes, used_bytes, models, cache_size, load
    process: dict | None = None  # CPU seconds so far: cpu_s (this process), loop_cpu_s (its event loop), workers_cpu_s

    @classmethod
    def from_dict(cls, data: dict) -> "DaemonStatus":
        known = {f for f in cls.__dataclass_fields__}
        fields = {k: v for k, v in data.items() if k in known}
        mknown = set(ModelStatus.__dataclass_fields__)
        fields["models"] = [ModelStatus(**{k: v for k, v in m.items() if k in mknown}) for m in data.get("models", [])]
        return cls(**fields)

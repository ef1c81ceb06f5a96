"""Engine configuration: dataclasses with defaults, loaded from YAML and validated.

The same file is read by `gpuserv bench --config`, `gpuserv generate` and (with
more sections) the daemon, so scheduling settings can be compared on a
workload before they go live. Unknown keys are errors, not ignored: a typo in
a config file should never silently run the defaults.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from gpuservd.dtypes import choose_dtype
from gpuservd.errors import Choice, UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2,
          "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4}


def parse_bytes(value, where: str) -> int:
    """An int, or a string like '2GiB' / '512MB', as bytes."""
    if isinstance(value, bool):
        raise UserError(f"{where}: expected a size like 2GiB, got {value!r}")
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        raise UserError(f"{where}: expected a size like 2GiB or 512MB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


# The named choices of the engine's settings. They live here, beside the settings they name, so
# that validating a config needs nothing of the engine; the engine imports them from here.
class Policy(Choice, setting="scheduler.policy"):
    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # higher priority first, then arrival


class Order(Choice, setting="scheduler.order"):
    SRF = "srf"  # shortest remaining work first (with aging), within a priority
    FCFS = "fcfs"  # arrival order, within a priority


class VictimPolicy(Choice, setting="preemption.victim_policy"):
    NEWEST = "newest"
    MOST_REMAINING = "most_remaining"
    PROGRESS = "progress"
    WEIGHTED = "weighted"
    SRF = "srf"  # the request SRF would rank last: the most aged remaining work


class PreemptionMode(Choice, setting="preemption.mode"):
    AUTO = "auto"
    ON = "on"
    OFF = "off"


class Granularity(Choice, setting="preemption.granularity"):
    REQUEST = "request"
    TOKEN = "token"
    LAYER = "layer"


class MoveKind(Choice, setting="preemption.kind"):
    AUTO = "auto"  # the planner decides per victim
    SWAP = "swap"  # every layer to the host
    PARTIAL_SWAP = "partial_swap"  # layers [0, L-k) to the host, the last k parked on the device
    RECOMPUTE = "recompute"  # drop the oldest blocks; rebuilt by a prefix prefill on resume


ISOLATIONS = ("auto", "thread", "process")  # engine.isolation: where the daemon runs each model's engine


@dataclass
class SchedulerConfig:
    """Batch formation limits; prefill and decode are limited separately (each
    has its own batch size past which it stops gaining)."""

    policy: str = "fcfs"  # see engine.policy.Policy: the tie-break after priority and order
    order: str = "srf"  # srf | fcfs: equal-priority requests by least remaining work, or by arrival (engine/policy.py)
    # srf aging, in tokens per engine step: a waiting request's claim (its remaining work, in tokens)
    # shrinks by this much for every step since it arrived. A running request works off 1 token a step,
    # so at 1.0 waiting counts as if it were running: after (its work / aging) steps its claim is 0 and
    # only earlier arrivals (and higher priorities) still go first. Steps rather than seconds, so that the
    # same workload is ordered the same way on a CPU and a GPU whose steps are 20x shorter. Chosen on the
    # mixed-short-long burst at 16 running sequences (the real engine on a tiny model, time in steps): the
    # longest request finished after 1.16x its steps under fcfs and the short class's P99 fell to 0.62x;
    # rates 2 and 4 gave 1.17x with less for the short class (0.63x, 0.76x). In wall time the srf tail
    # (fewer sequences a step) costs less than its step count: a step-time model put it at 1.05x.
    aging: float = 1.0
    max_num_seqs: int = 64  # running sequences (the decode batch) at most
    max_num_batched_tokens: int = 512  # tokens per step, prefill + decode
    max_prefill_tokens: int = 256  # prefill tokens per step (the chunk budget)
    max_num_prefill_seqs: int = 8  # sequences that may prefill in one step
    # srf deferral: while at least `defer_min_running` sequences run, a waiting request whose aged claim is
    # `defer_ratio` times (or more) the largest running claim is not admitted, even to a free slot. On a CPU
    # every row of a step costs every co-runner time (a step is compute-bound from a few rows: bf16 on the
    # 2-core Zen 4, 9 rows took 16 ms, 17 rows 24 ms), and a long request's prompt is one long step for all of
    # them: a long request taking a slot the moment one frees slows the short ones still running. It joins
    # once the batch narrows below `defer_min_running`, or once aging has brought its claim within the ratio
    # (at most its work / aging steps: the aging bound holds). 0 turns it off. At 1 it joins when the last
    # request of the smaller size is done. On the mixed-short-long burst (48 running, scripts/burst_breakdown.py
    # --simulate) 16 -> 1 took the short class's P99 from 13.0 to 11.9 s (the real engine: 2564 prompt tokens
    # and 2314 decode rows in the short phase -> 2267 and 2115, the 8 longs' prompts and rows left out), the
    # longest request from 31.7 to 32.3 s (fcfs: 30.6 s), 159 -> 156 tok/s; on long-tail-drag the shorts'
    # slowest 2.83 -> 2.65 s, the long one 14.7 -> 15.7 s (fcfs: 14.7). No change on the poisson workloads
    # (a running long request makes the largest claim, so nothing of its size waits).
    defer_ratio: float = 2.0
    defer_min_running: int = 1
    # srf's critical lane: the largest waiting request (prompt + max_tokens) is admitted ahead of the
    # smaller ones, past the deferral, when it is larger than every running request. A burst ends when its
    # longest request does, and that request's tokens come one a step whatever the batch: held back until
    # the short ones are done, it runs its whole length on the narrow, bandwidth-bound steps at the end. In
    # the lane it costs the short ones one slot of a batch of 8 or more sequences (narrower batches have
    # no lane). Off while preemption is on (displacement gives shorter work the slot back at once).
    critical_lane: bool = True


@dataclass
class VictimWeights:
    """Weights of the `weighted` victim policy (each term normalised to 0..1 over the candidates)."""

    remaining: float = 1.0  # more tokens left -> better victim
    priority: float = 1.0  # higher priority -> worse victim
    spent: float = 1.0  # more computed tokens (work lost on recompute) -> worse victim


@dataclass
class PreemptionConfig:
    """When running requests give way, who gives way, and how their KV leaves.

    See engine/preemption.py (triggers and the planner) and engine/victim.py (who).
    """

    mode: str = "auto"  # auto | on | off: on lets waiting requests displace running ones
    granularity: str = "token"  # request | token | layer: how often a running request can be stopped
    kind: str = "auto"  # auto (the planner) | swap | partial_swap | recompute
    victim_policy: str = "progress"  # newest | most_remaining | progress | weighted | srf (engine/victim.py)
    max_preemptions: int = 3  # a request preempted this many times is not chosen again (aging)
    min_exec_s: float = 0.2  # a request runs at least this long after (re)admission before it can be chosen
    weights: VictimWeights = field(default_factory=VictimWeights)
    memory_threshold: float = 0.85  # with preemption on, device KV use is kept at or below this share
    swap_space_bytes: int = 512 * 1024**2  # the host KV pool (pinned RAM on CUDA)
    partial_keep_fraction: float = 0.25  # partial swap keeps this share of the layers (the last ones) on the device
    outrank_ratio: float = 4.0  # equal priority: a waiting request displaces a running one whose remaining
    # token estimate (max_tokens - generated) is at least this many times its own
    auto_window: int = 200  # auto mode: output lengths of this many recent finished requests
    auto_ratio: float = 5.0  # auto mode: preemption on while P99/P50 of those lengths is above this
    auto_min_samples: int = 20  # auto mode: no decision before this many finished requests


# Decode batches are padded up to one of these sizes (runner/decode_step.py): one CUDA graph per size.
DEFAULT_CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def check_batch_sizes(sizes, setting: str = "engine.cuda_graphs.batch_sizes") -> tuple[int, ...]:
    """Bucket sizes as a tuple; a one-line UserError naming the setting unless they are increasing positive ints."""
    if isinstance(sizes, (str, bytes, dict)) or not hasattr(sizes, "__len__") or not sizes:
        raise UserError(f"{setting} must be a non-empty list of increasing positive integers, got {sizes!r}")
    if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes):
        raise UserError(f"{setting} must hold positive integers, got {list(sizes)!r}")
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        raise UserError(f"{setting} must be strictly increasing, got {list(sizes)!r}")
    return tuple(sizes)


@dataclass
class CudaGraphsConfig:
    """Decode-only steps as CUDA graphs over a fixed-shape batch padded to a bucket size (runner/cuda_graphs.py).

    enabled: None (the default) = on for a CUDA device; true = asked for explicitly (on the CPU that is
    a logged fallback to eager that /admin/status and `gpuserv doctor` report); false = off.
    GPUSERV_CUDA_GRAPHS=0 in the environment turns them off whatever this says."""

    enabled: bool | None = None
    batch_sizes: list = field(default_factory=lambda: list(DEFAULT_CUDA_GRAPH_BATCH_SIZES))


@dataclass
class EngineConfig:
    """One model's engine on one device."""

    model: str = "smollm2"  # name in the model store
    device: str = "cpu"  # "cpu" or "cuda:N"
    devices: list = field(default_factory=list)  # the daemon's devices (requests go where their model is):
    # [cuda:0, cuda:1] or CPU device slots [cpu:0, cpu:1]; empty = [device]. Each is its own device tier.
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16; auto: gpuservd/dtypes.py chooses for the device
    dtype_reason: str = field(default="", metadata={"derived": True})  # why this dtype (set by validate)
    num_threads: int | None = None  # torch intra-op threads; None = torch's default
    block_size: int = 16  # tokens per KV block
    device_memory_bytes: int = 4 * 1024**3  # the device tier's budget (RAM on the CPU)
    kv_cache_bytes: int | None = None  # KV pool size; None = kv_cache_fraction of what weights leave
    kv_cache_fraction: float = 0.4  # of device_memory_bytes minus weights
    max_model_len: int | None = None  # context limit; None = the model's (and its sliding window)
    telemetry_ring_size: int = 4096  # per-step records kept in memory
    prefix_caching: bool = True  # reuse cached KV blocks of repeated prompt prefixes (kv_cache/prefix_cache.py)
    isolation: str = "auto"  # the daemon's: thread (an engine thread of its process) | process (an engine
    # worker process per model: fault isolation, and what MPS confines; sharing.backend mps implies it) | auto
    # (a process for a CPU model that needs nothing of the thread, else a thread: SharingManager.isolation)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    cuda_graphs: CudaGraphsConfig = field(default_factory=CudaGraphsConfig)
    # Schedule decode step N+1 on the host while step N runs on the device (engine/overlap.py): None = on
    # for a CUDA device with the fixed-shape decode step; true = wherever that step runs (on the CPU the
    # forward is not asynchronous, so there it only reorders the host work); false = off.
    overlap: bool | None = None

    def device_names(self) -> list[str]:
        """The daemon's devices: engine.devices, else [engine.device] (one device)."""
        return check_devices(self.devices) if self.devices else [self.device]

    def validate(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise UserError(f"engine.dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise UserError(f"engine.device must be cpu or cuda:N, got {self.device!r}")
        devices = self.device_names()
        self.resolve_dtype(devices[0])
        if self.isolation not in ISOLATIONS:
            raise UserError(f"engine.isolation must be one of {', '.join(ISOLATIONS)}, got {self.isolation!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise UserError(f"engine.block_size must be a power of two, got {self.block_size}")
        if not isinstance(self.prefix_caching, bool):
            raise UserError(f"engine.prefix_caching must be true or false, got {self.prefix_caching!r}")
        if not (0.0 < self.kv_cache_fraction <= 1.0):
            raise UserError(f"engine.kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if not (self.cuda_graphs.enabled is None or isinstance(self.cuda_graphs.enabled, bool)):
            raise UserError(f"engine.cuda_graphs.enabled must be true or false, got {self.cuda_graphs.enabled!r}")
        check_batch_sizes(self.cuda_graphs.batch_sizes)
        if not (self.overlap is None or isinstance(self.overlap, bool)):
            raise UserError(f"engine.overlap must be true or false, got {self.overlap!r}")
        s = self.scheduler
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_prefill_tokens", "max_num_prefill_seqs"):
            if getattr(s, name) < 1:
                raise UserError(f"scheduler.{name} must be >= 1, got {getattr(s, name)}")
        if s.max_num_batched_tokens < s.max_num_seqs:
            raise UserError(
                f"scheduler.max_num_batched_tokens ({s.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({s.max_num_seqs}) so every running sequence can decode each step"
            )
        Policy.parse(s.policy)
        Order.parse(s.order)
        if not s.aging > 0:  # also rejects NaN
            raise UserError(f"scheduler.aging must be > 0 tokens per step (without aging a long request could "
                            f"wait forever behind shorter ones), got {s.aging!r}")
        if not (s.defer_ratio == 0 or s.defer_ratio > 1) or s.defer_min_running < 1:
            raise UserError(f"scheduler.defer_ratio must be 0 (off) or > 1 and scheduler.defer_min_running >= 1, "
                            f"got {s.defer_ratio!r} and {s.defer_min_running!r}")
        VictimPolicy.parse(self.preemption.victim_policy)
        p = self.preemption
        if p.max_preemptions < 1 or p.min_exec_s < 0:
            raise UserError("preemption.max_preemptions must be >= 1 and preemption.min_exec_s >= 0")
        PreemptionMode.parse(p.mode)
        Granularity.parse(p.granularity)
        MoveKind.parse(p.kind)
        if not (0.0 < p.memory_threshold <= 1.0):
            raise UserError(f"preemption.memory_threshold must be in (0, 1], got {p.memory_threshold}")
        if not (0.0 <= p.partial_keep_fraction < 1.0):
            raise UserError(f"preemption.partial_keep_fraction must be in [0, 1), got {p.partial_keep_fraction}")
        if p.swap_space_bytes < 0:
            raise UserError(f"preemption.swap_space_bytes must be >= 0, got {p.swap_space_bytes}")
        if p.outrank_ratio < 1.0 or p.auto_ratio <= 1.0 or p.auto_window < 2 or p.auto_min_samples < 2:
            raise UserError("preemption: outrank_ratio must be >= 1, auto_ratio > 1, auto_window and "
                            "auto_min_samples >= 2")

    def resolve_dtype(self, device: str, flags: set[str] | None = None) -> None:
        """`auto` becomes the device's best dtype (gpuservd/dtypes.py), with the reason in dtype_reason; an explicit
        dtype is kept and says so. flags: the CPU's feature flags (None: /proc/cpuinfo)."""
        if self.dtype == "auto":
            self.dtype, why = choose_dtype(device, flags)
            self.dtype_reason = f"auto: {why}"
        elif not self.dtype_reason:
            self.dtype_reason = "set in the config (engine.dtype)"


_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")


def torch_device(name: str) -> str:
    """The torch device a device slot computes on: a CPU slot (cpu:N) runs on "cpu"."""
    return "cpu" if name.startswith("cpu") else name


def check_device(device: str, what: str = "engine.device") -> str:
    """One device, cpu or a visible cuda:N; `what` names it in the message (a flag, a config key)."""
    if device == "cpu":
        return device
    if not re.fullmatch(r"cuda(:\d+)?", device):
        raise UserError(f"{what} must be cpu or cuda:N, got {device!r}")
    import torch  # only for a cuda:N device: the CLI imports this module and must start without torch

    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(device.partition(":")[2] or 0) >= visible:
        why = (f"torch {torch.__version__} is a CPU build" if torch.version.cuda is None
               else f"{visible} CUDA devices visible")
        raise UserError(f"{what} {device} is not there ({why})")
    return device


def check_devices(devices, visible_cuda=None) -> list[str]:
    """engine.devices validated: known strings, no duplicates, not a mix of cpu and cuda, cuda:N
    within the visible devices (visible_cuda: their count; None = ask torch). Returns the names."""
    if not isinstance(devices, list) or any(not isinstance(d, str) for d in devices):
        raise UserError(f"engine.devices must be a list like [cuda:0, cuda:1] or [cpu:0, cpu:1], got {devices!r}")
    seen: dict[tuple[str, int], str] = {}
    for d in devices:
        m = _DEVICE.fullmatch(d.strip())
        if not m:
            raise UserError(f"engine.devices: unknown device {d!r}; use cpu:N (a CPU device slot) or cuda:N")
        key = (m.group(1), int(m.group(2) or 0))
        if key in seen:
            raise UserError(f"engine.devices lists {seen[key]!r} twice" if seen[key] == d else
                            f"engine.devices: {seen[key]!r} and {d!r} are the same device")
        seen[key] = d
    kinds = {k for k, _ in seen}
    if len(kinds) > 1:
        raise UserError(f"engine.devices mixes cpu and cuda devices ({', '.join(devices)}); use one kind")
    cuda = sorted(i for k, i in seen if k == "cuda")
    if cuda:
        if visible_cuda is None:
            import torch  # as in check_device: only when a CUDA device is named

            visible_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if cuda[-1] >= visible_cuda:
            raise UserError(f"engine.devices: cuda:{cuda[-1]} is not there ({visible_cuda} CUDA devices visible)")
    return [d.strip() for d in devices]


def _fill(obj, data: dict, where: str, path: str):
    """Set dataclass fields from a dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: {path or 'top level'} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(obj) if not f.metadata.get("derived")}
    for key, value in data.items():
        if key not in fields:
            raise UserError(f"{where}: unknown key {path}{key!r}; known: {', '.join(sorted(fields))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _fill(current, value, where, f"{path}{key}.")
        elif key.endswith("_bytes") and value is not None:
            setattr(obj, key, parse_bytes(value, f"{where}: {path}{key}"))
        else:
            expected = type(current) if current is not None else None
            if expected in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise UserError(f"{where}: {path}{key} must be a number, got {value!r}")
            if expected is str and not isinstance(value, str):
                raise UserError(f"{where}: {path}{key} must be a string, got {value!r}")
            setattr(obj, key, int(value) if expected is int else value)


def config_from_dict(data: dict, where: str = "config") -> EngineConfig:
    """Build an EngineConfig from {'engine': {...}, 'scheduler': {...}, 'preemption': {...}}
    (other sections are for the daemon)."""
    cfg = EngineConfig()
    data = data or {}
    if not isinstance(data, dict):
        raise UserError(f"{where}: the top level must be a mapping with an 'engine:' section")
    engine = dict(data.get("engine") or {})
    for section in ("scheduler", "preemption"):
        if section in data:
            engine[section] = data[section]
    _fill(cfg, engine, where, "engine." if "engine" in data else "")
    cfg.validate()
    return cfg


def read_yaml_file(path: Path):
    """Parse a YAML config file; a missing file or bad YAML is a one-line UserError."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise UserError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None


def load_config(path: Path | str | None) -> EngineConfig:
    """Read an engine config YAML file; None gives the defaults."""
    if path is None:
        cfg = EngineConfig()
        cfg.validate()
        return cfg
    return config_from_dict(read_yaml_file(Path(path)), where=str(path))

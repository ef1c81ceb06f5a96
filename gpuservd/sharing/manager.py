"""The daemon's side of sharing one device between models: partitions, time slices,
memory quotas and bandwidth priority.

One SharingManager per daemon holds what the other pieces compute:
  - the partition backend (gpu/backends.py: green contexts, MPS or none) and
    the plan (sharing/planner.py: SM groups, memory quotas), redone whenever
    the set of loaded models changes;
  - the arbiter (sharing/arbiter.py): time slices and bandwidth priority, one
    registration per loaded model;
  - memory quotas applied to each engine's KV pool: a model over its quota
    moves its own requests out (the scheduler's `quota` preemptions), never
    another model's;
  - the device readings (gpu/readings.py), sampled once a second for status
    and the hint rules.

Engine threads and worker processes (`engine.isolation`): under the mps
backend every model runs in an engine worker process whose environment carries
its SM percentage and memory limit (`worker_env`), the only way MPS confines
anything. A model in a worker process is not registered with the arbiter (its
time slices and throttle pace engine threads of this process); status says so
per model (`arbiter.not_time_sliced`). Its memory quota still caps its KV pool:
the cap is sent to the worker (engine.calls.set_kv_limit).

Groups: with an enforcing backend each SM group is a partition of its own and
the models in it take turns; without one nothing keeps partitions apart, so
every model is in one group, `device`, and the whole device is time-sliced.

Several devices (`engine.devices`; a request goes to the device that holds its
model): groups are per device, so models on different devices never take turns
with each other: the time-sliced group is the device's name (`cpu:1`, `cuda:0`)
and an enforcing backend's SM group `g` becomes `cuda:0/g`. With one device the names stay `device` and `g`. The plan
is made per device (each device's models against its own memory) and merged
(`merge_plans`). Not yet per device: the SM partitions (made on engine.device)
and the bandwidth throttle (one arbiter sees every device's models; right for
CPU slots, which share the memory bus, not for separate GPUs).
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

from gpuservd.engine.calls import set_kv_limit
from gpuservd.errors import UserError
from gpuservd.gpu.backends import MpsBackend, choose_backend
from gpuservd.gpu.readings import DeviceReader, cuda_index
from gpuservd.sharing.arbiter import Arbiter
from gpuservd.sharing.hardware import hardware_from_device, load_hardware
from gpuservd.sharing.planner import Plan, plan

log = logging.getLogger("gpuservd.sharing")
SHARED_GROUP = "device"


def merge_plans(plans: dict):
    """Per-device plans (device -> Plan) as one: groups `device/group`, quotas and fits side by side,
    memory the devices' sum, warnings prefixed with their device."""
    ps = list(plans.values())
    if len(ps) == 1 and not next(iter(plans)):
        return ps[0]
    memory = None if any(p.memory_bytes is None for p in ps) else sum(p.memory_bytes for p in ps)
    return Plan(ps[0].hardware if ps else None,
                [dataclasses.replace(g, name=f"{d}/{g.name}") for d, p in plans.items() for g in p.groups],
                sum(p.spare_sms for p in ps), {n: q for p in ps for n, q in p.quotas.items()},
                {n: f for p in ps for n, f in p.fits.items()}, memory,
                [f"{d}: {w}" for d, p in plans.items() for w in p.warnings])


def bandwidth_domain(device: str) -> str:
    """Models whose steps compete for one memory bus: a GPU's HBM is its own; CPU device slots share the host's."""
    return "cpu" if device.startswith("cpu") else device


class SharingManager:
    def __init__(self, config, device: dict, reader=None):
        self.config = config  # the DaemonConfig
        self.device = device
        dev = config.engine.device
        self.backend = choose_backend(config.sharing.backend, dev)  # UserError: asked for one that is not there
        self.hardware = self._hardware()
        self.arbiter = Arbiter(config.sharing, dev) if config.sharing.enabled else None
        self.plan = None
        self.plan_error: str | None = None
        self.names: list[str] = []
        self.pools: dict[str, tuple[int, int, object]] = {}  # model -> (bytes per KV block, blocks, () -> used)
        self.isolated: dict[str, int | None] = {}  # models in worker processes -> the worker's pid (None: starting)
        self.kv_caps: dict[str, int | None] = {}  # model -> KV blocks its quota allows (None = the whole pool)
        self.reader = reader if reader is not None else DeviceReader(dev)
        self.readings: dict | None = None
        self.multi_device = len(config.engine.device_names()) > 1
        self.device_of: dict[str, str] = {}  # model -> the device it was routed to

    def _hardware(self):
        sc, profiles = self.config.sharing, self.config.server.profiles_path()
        if sc.hardware != "auto":
            return load_hardware(sc.hardware, profiles)
        return hardware_from_device(self.device, profiles)  # None on a CPU

    # ---- models coming and going ------------------------------------------------------------------
    def group_of(self, name: str, device: str | None = None) -> str:
        """The arbiter group: per device with several devices, so models on two devices never take turns."""
        group = self.config.sharing.group_of(name) if self.backend.enforced else SHARED_GROUP
        device = device or self.device_of.get(name)
        if not self.multi_device or not device:
            return group
        return f"{device}/{group}" if self.backend.enforced else device

    def replan(self, names: list[str]) -> None:
        """The plan for the models now loaded (or loading); shares go to the arbiter at once. With several
        devices, one plan per device over the models on it (quotas checked against that device's memory),
        merged: groups named `device/group`, warnings prefixed with the device."""
        self.names = sorted(set(names))
        sc = self.config.sharing
        try:
            if self.multi_device:
                by_device: dict[str, list[str]] = {}
                for n in self.names:
                    by_device.setdefault(self.device_of.get(n, ""), []).append(n)
                self.plan = merge_plans({d: self._plan_for(ns) for d, ns in sorted(by_device.items())}) \
                    if by_device else self._plan_for([])
            else:
                self.plan = self._plan_for(self.names)
            self.plan_error = None
        except UserError as exc:  # the daemon serves on; status and the log say why there is no plan
            self.plan, self.plan_error = None, str(exc)
            log.warning("sharing plan for %s: %s", ", ".join(self.names) or "no models", exc)
        if self.arbiter is not None:
            self.arbiter.reconfigure(sc, sc.shares(self.names))

    def _plan_for(self, names: list[str]):
        return plan(self.config.sharing, self.hardware, names, engine=self.config.engine,
                    memory_bytes=None if self.hardware else self.config.engine.device_memory_bytes)

    def prepare(self, names: list[str]) -> dict:
        """At start, before any engine: an enforcing backend makes the SM groups of the plan for these models
        and the ones sharing.models lists, all at once (disjoint). Models loaded later bind to their group
        when the plan has it; a group the start plan lacked gets a context of its own (see gpu/backends.py).
        Changing the groups of running models needs a restart: their streams live on the contexts."""
        if not self.backend.enforced:
            return {}

        every = sorted(set(names) | set(self.config.sharing.models))
        try:
            p = plan(self.config.sharing, self.hardware, every, engine=self.config.engine, with_quotas=False)
        except UserError as exc:
            log.warning("SM partitions not made: %s", exc)
            return {}
        made = self.backend.prepare({g.name: g.num_sms for g in p.groups})
        log.info("SM partitions: %s", made)
        return made

    def isolation(self, configured: str, device: str, variant: bool = False) -> str:
        """Where a model's engine runs: `process` under the mps backend (MPS confines processes only),
        else engine.isolation, where `auto` is decided per model.

        auto is a worker process for a CPU model that needs nothing of an engine thread. In a thread the
        engine shares the interpreter's lock with the event loop that streams its tokens: with the engine
        in a worker the daemon served a 48-stream mixed burst 11-20% faster on 2 cores (README, "Engine
        worker processes"). It stays a thread for a variant (it runs on its base's weights in the
        daemon's memory), for a GPU (time slices, SM partitions and the launch path are built around
        engine threads) and where sharing.models asks the arbiter for shares or classes, which it
        enforces on engine threads only."""
        if self.backend.name == "mps":
            return "process"
        if configured != "auto":
            return configured
        wants_arbiter = self.arbiter is not None and bool(self.config.sharing.models)
        on_cpu = (device or self.config.engine.device).startswith("cpu")
        return "process" if on_cpu and not variant and not wants_arbiter else "thread"

    def attach(self, name: str, device: str | None = None, isolation: str = "thread"):
        """Register a model that is about to load (on `device`); returns its arbiter handle (None without
        an arbiter, and for a model in a worker process: the arbiter paces engine threads only)."""
        if device:
            self.device_of[name] = device
        if isolation == "process":
            self.isolated[name] = None
        self.replan(self.names + [name])
        if self.arbiter is None or isolation == "process":
            return None
        sc = self.config.sharing
        spec = sc.model(name)
        dev = self.device_of.get(name) or self.config.engine.device
        return self.arbiter.register(name, self.group_of(name), sc.shares(self.names)[name], spec.sharing_class,
                                     spec.step_target_ms, bandwidth_domain=bandwidth_domain(dev))

    def bind(self, name: str) -> None:
        """On the model's engine thread, before its engine is built: its SM partition (enforcing backends)."""
        if not self.backend.enforced or self.plan is None:
            return
        group = self.plan.group_of(name)
        if group is not None:
            self.backend.bind(name, group.num_sms, group.name)

    def unbind(self, name: str) -> None:
        """On the model's engine thread as it ends."""
        self.backend.unbind(name)

    def worker_env(self, name: str) -> dict[str, str]:
        """The environment `name`'s worker process adds to the daemon's: under the mps backend its SM
        percentage (from its plan group), memory limit (its quota) and the control daemon's pipe; {} else."""
        if not isinstance(self.backend, MpsBackend):
            return {}
        group = self.plan.group_of(name) if self.plan is not None else None
        quota = self.plan.quotas.get(name) if self.plan is not None else None
        total = self.hardware.num_sms if self.hardware is not None else None
        if group is None or not total:
            why = self.plan_error or "no SM plan for it (sharing.hardware names no GPU)"
            raise UserError(f"model {name}: no MPS settings for its worker process: {why}")

        device = self.device_of.get(name)  # with several devices: the GPU the model was routed to
        return self.backend.worker_env(name, group.num_sms, total, quota.quota if quota is not None else None,
                                       cuda_index(device) if device else None)

    def worker_started(self, name: str, pid: int) -> None:
        self.isolated[name] = pid
        self.backend.worker_started(name, pid)

    def loaded(self, name: str, engine) -> None:
        """The engine is built (on its thread): apply the model's memory quota to its KV pool."""
        pool = engine.pool
        cap = self.pool_loaded(name, engine.runner.cache.shape.bytes_per_block, pool.num_blocks, lambda: pool.num_used)
        pool.set_limit(cap)

    def pool_loaded(self, name: str, bytes_per_block: int, num_blocks: int, used) -> int | None:
        """A model's KV pool (`used()` -> blocks in use now); returns the cap its memory quota sets (None: no cap),
        which the caller applies in the engine (an engine thread directly, a worker through set_kv_limit)."""
        self.pools[name] = (bytes_per_block, num_blocks, used)
        self.kv_caps[name] = cap = self.kv_cap(name)
        if cap is not None:
            log.info("model %s: memory quota allows %d of its %d KV blocks", name, cap, num_blocks)
        return cap

    def detach(self, name: str) -> None:
        self.device_of.pop(name, None)
        self.pools.pop(name, None)
        self.kv_caps.pop(name, None)
        if self.isolated.pop(name, 0) != 0:
            self.backend.unbind(name)  # a worker's MPS settings go with it
        if self.arbiter is not None:
            self.arbiter.unregister(name)
        self.replan([n for n in self.names if n != name])

    def kv_cap(self, name: str) -> int | None:
        """KV blocks the quota leaves after weights, activations and overhead; None when it is no limit."""
        q = self.plan.quotas.get(name) if self.plan is not None else None
        if q is None or name not in self.pools:
            return None
        per_block, num_blocks, _ = self.pools[name]
        other = sum(x or 0 for x in (q.weights, q.activations, q.overhead))
        blocks = max(1, (q.quota - other) // per_block)
        return int(blocks) if blocks < num_blocks else None

    def reconfigure(self, sharing, call_on_engine) -> list[str]:
        """A reload: new shares, classes, targets, quantum, throttle and quotas apply now (quotas between
        steps, through call_on_engine(model, fn(engine))); returns the settings that need a restart."""
        old = self.config.sharing
        restart = [k for k in ("enabled", "backend", "hardware") if getattr(old, k) != getattr(sharing, k)]
        restart += ["sharing.models.*.group"] if any(old.group_of(n) != sharing.group_of(n) for n in self.names) else []
        for k in ("enabled", "backend", "hardware"):
            setattr(sharing, k, getattr(old, k))  # these keep their running values until a restart
        self.config.sharing = sharing
        self.replan(self.names)

        for name in list(self.pools):
            self.kv_caps[name] = cap = self.kv_cap(name)
            call_on_engine(name, partial(set_kv_limit, cap))
        return [r if r.startswith("sharing.") else f"sharing.{r}" for r in restart]

    # ---- reading ----------------------------------------------------------------------------------
    def sample(self) -> dict:
        """Device readings now (a thread: NVML calls can take tens of ms)."""
        self.readings = self.reader.read()
        if self.arbiter is not None:
            self.arbiter.observe_readings(self.readings)
        return self.readings

    def take_events(self) -> list:
        return self.arbiter.take_events() if self.arbiter is not None else []

    def status(self) -> dict:
        """/admin/status's `sharing`, `partitions`, `quotas` and `arbiter` sections."""
        p = self.plan.to_dict() if self.plan is not None else None
        summary = self.backend.status()
        partitions = {"backend": self.backend.name, "enforced": bool(self.backend.enforced),
                      "summary": summary.get("summary"), "hardware": p["hardware"] if p else None,
                      "groups": p["groups"] if p else [], "spare_sms": p["spare_sms"] if p else None,
                      "time_slice_group": None if self.backend.enforced else
                      (", ".join(sorted(set(self.device_of.values()))) if self.multi_device else SHARED_GROUP),
                      "warnings": p["warnings"] if p else [], "error": self.plan_error}
        quotas = {}
        for name, q in ((p or {}).get("quotas") or {}).items():
            pool = self.pools.get(name)
            row = dict(q)
            if pool is not None:
                row["kv_used_bytes"], row["used_bytes"] = self._quota_use(name, q["weights"], q["activations"],
                                                                          q["overhead"])
                row["kv_cap_blocks"] = self.kv_caps.get(name)
            quotas[name] = row
        arbiter = self.arbiter.status() if self.arbiter is not None else {
            "enabled": False, "reason": "sharing.enabled is false: models step whenever they have work"}
        if self.arbiter is not None and self.isolated:
            arbiter = {**arbiter, "not_time_sliced": {
                n: "runs in an engine worker process: the arbiter paces engine threads of the daemon only"
                for n in sorted(self.isolated)}}
        return {"backend": summary, "partitions": partitions, "quotas": quotas, "arbiter": arbiter}

    def metric_rows(self) -> dict:
        """What /metrics reads of status(): the arbiter's counters and each quota with its use, without the
        plan's and backend's descriptions."""
        quotas = {}
        for name, q in (self.plan.quotas if self.plan is not None else {}).items():
            used = self._quota_use(name, q.weights, q.activations, q.overhead)[1] if name in self.pools else None
            quotas[name] = {"quota": q.quota, "used_bytes": used}
        arbiter = self.arbiter.counters() if self.arbiter is not None else {"enabled": False}
        return {"arbiter": arbiter, "quotas": quotas}

    def _quota_use(self, name: str, *fixed: int | None) -> tuple[int, int]:
        """(KV bytes in use, all bytes in use) of a model with a KV pool: its fixed parts plus its KV."""
        per_block, _, used = self.pools[name]
        kv = used() * per_block
        return kv, sum(x or 0 for x in fixed) + kv

    def model_fields(self, name: str) -> dict:
        spec = self.config.sharing.model(name)
        group = None
        if self.plan is not None and self.plan.group_of(name) is not None:
            g = self.plan.group_of(name)
            group = {"name": self.group_of(name), "num_sms": g.num_sms}
        return {"sharing_class": spec.sharing_class.value, "sharing_group": group["name"] if group else
                self.group_of(name), "num_sms": group["num_sms"] if group and self.backend.enforced else None,
                "isolation": "process" if name in self.isolated else "thread", "worker_pid": self.isolated.get(name),
                "worker_env": self.backend.env_of(name)}

    def close(self) -> None:
        self.backend.close()

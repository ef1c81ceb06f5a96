"""The daemon's side of sharing one device between models (MISSION G1-G5).

One SharingManager per daemon holds what the other pieces compute:
  - the partition backend (gpu/backends.py: green contexts, MPS or none) and
    the plan (sharing/planner.py: SM groups, memory quotas), redone whenever
    the set of loaded models changes;
  - the arbiter (sharing/arbiter.py): time slices and bandwidth priority, one
    registration per loaded model;
  - memory quotas applied to each engine's KV pool (G3): a model over its quota
    moves its own requests out (the scheduler's `quota` preemptions), never
    another model's;
  - the device readings (gpu/readings.py), sampled once a second for status
    and the hint rules.

Groups: with an enforcing backend each SM group is a partition of its own and
the models in it take turns; without one nothing keeps partitions apart, so
every model is in one group, `device`, and the whole device is time-sliced.

Several devices (M8, `engine.devices`): groups are per device, so models on
different devices never take turns with each other: the time-sliced group is
the device's name (`cpu:1`, `cuda:0`) and an enforcing backend's SM group `g`
becomes `cuda:0/g`. With one device the names stay `device` and `g`. The plan
is made per device (each device's models against its own memory) and merged
(`merge_plans`). Not yet per device: the SM partitions (made on engine.device)
and the bandwidth throttle (one arbiter sees every device's models; right for
CPU slots, which share the memory bus, not for separate GPUs).
"""

from __future__ import annotations

import logging

from gpuservd.errors import UserError

log = logging.getLogger("gpuservd.sharing")
SHARED_GROUP = "device"


def merge_plans(plans: dict):
    """Per-device plans (device -> Plan) as one: groups `device/group`, quotas and fits side by side,
    memory the devices' sum, warnings prefixed with their device."""
    import dataclasses

    from gpuservd.sharing.planner import Plan

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
        from gpuservd.gpu.backends import choose_backend
        from gpuservd.gpu.readings import DeviceReader
        from gpuservd.sharing.arbiter import Arbiter

        self.config = config  # the DaemonConfig
        self.device = device
        dev = config.engine.device
        self.backend = choose_backend(config.sharing.backend, dev)  # UserError: asked for one that is not there
        self.hardware = self._hardware()
        self.arbiter = Arbiter(config.sharing, dev) if config.sharing.enabled else None
        self.plan = None
        self.plan_error: str | None = None
        self.names: list[str] = []
        self.engines: dict = {}  # model -> LLMEngine (for quota usage)
        self.kv_caps: dict[str, int | None] = {}  # model -> KV blocks its quota allows (None = the whole pool)
        self.reader = reader if reader is not None else DeviceReader(dev)
        self.readings: dict | None = None
        self.multi_device = len(config.engine.device_names()) > 1
        self.device_of: dict[str, str] = {}  # model -> its device (M8)

    def _hardware(self):
        from gpuservd.sharing.hardware import hardware_from_device, load_hardware

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
        from gpuservd.sharing.planner import plan

        return plan(self.config.sharing, self.hardware, names, engine=self.config.engine,
                    memory_bytes=None if self.hardware else self.config.engine.device_memory_bytes)

    def prepare(self, names: list[str]) -> dict:
        """At start, before any engine: an enforcing backend makes the SM groups of the plan for these models
        and the ones sharing.models lists, all at once (disjoint). Models loaded later bind to their group
        when the plan has it; a group the start plan lacked gets a context of its own (see gpu/backends.py).
        Changing the groups of running models needs a restart: their streams live on the contexts."""
        if not self.backend.enforced:
            return {}
        from gpuservd.sharing.planner import plan

        every = sorted(set(names) | set(self.config.sharing.models))
        try:
            p = plan(self.config.sharing, self.hardware, every, engine=self.config.engine, with_quotas=False)
        except UserError as exc:
            log.warning("SM partitions not made: %s", exc)
            return {}
        made = self.backend.prepare({g.name: g.num_sms for g in p.groups})
        log.info("SM partitions: %s", made)
        return made

    def attach(self, name: str, device: str | None = None):
        """Register a model that is about to load (on `device`); returns its arbiter handle (None without
        an arbiter)."""
        if device:
            self.device_of[name] = device
        self.replan(self.names + [name])
        if self.arbiter is None:
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

    def loaded(self, name: str, engine) -> None:
        """The engine is built (on its thread): apply the model's memory quota to its KV pool."""
        self.engines[name] = engine
        self.kv_caps[name] = cap = self.kv_cap(name, engine)
        engine.pool.set_limit(cap)
        if cap is not None:
            log.info("model %s: memory quota allows %d of its %d KV blocks", name, cap, engine.pool.num_blocks)

    def detach(self, name: str) -> None:
        self.device_of.pop(name, None)
        self.engines.pop(name, None)
        self.kv_caps.pop(name, None)
        if self.arbiter is not None:
            self.arbiter.unregister(name)
        self.replan([n for n in self.names if n != name])

    def kv_cap(self, name: str, engine) -> int | None:
        """KV blocks the quota leaves after weights, activations and overhead; None when it is no limit."""
        q = self.plan.quotas.get(name) if self.plan is not None else None
        if q is None:
            return None
        other = sum(x or 0 for x in (q.weights, q.activations, q.overhead))
        per_block = engine.runner.cache.shape.bytes_per_block
        blocks = max(1, (q.quota - other) // per_block)
        return int(blocks) if blocks < engine.pool.num_blocks else None

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
        for name in list(self.engines):
            call_on_engine(name, lambda engine, n=name: self.loaded(n, engine))
        return [r if r.startswith("sharing.") else f"sharing.{r}" for r in restart]

    # ---- reading ----------------------------------------------------------------------------------
    def sample(self) -> dict:
        """Device readings now (a thread: NVML calls can take tens of ms)."""
        self.readings = self.reader.read()
        if self.arbiter is not None:
            self.arbiter.observe_readings(self.readings)
        return self.readings

    def take_events(self) -> list[dict]:
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
            engine = self.engines.get(name)
            row = dict(q)
            if engine is not None:
                per_block = engine.runner.cache.shape.bytes_per_block
                row["kv_used_bytes"] = engine.pool.num_used * per_block
                row["kv_cap_blocks"] = self.kv_caps.get(name)
                row["used_bytes"] = sum(x or 0 for x in (q["weights"], q["activations"], q["overhead"])) \
                    + row["kv_used_bytes"]
            quotas[name] = row
        arbiter = self.arbiter.status() if self.arbiter is not None else {
            "enabled": False, "reason": "sharing.enabled is false: models step whenever they have work"}
        return {"backend": summary, "partitions": partitions, "quotas": quotas, "arbiter": arbiter}

    def model_fields(self, name: str) -> dict:
        spec = self.config.sharing.model(name)
        group = None
        if self.plan is not None and self.plan.group_of(name) is not None:
            g = self.plan.group_of(name)
            group = {"name": self.group_of(name), "num_sms": g.num_sms}
        return {"sharing_class": spec.sharing_class.value, "sharing_group": group["name"] if group else
                self.group_of(name), "num_sms": group["num_sms"] if group and self.backend.enforced else None}

    def close(self) -> None:
        self.backend.close()

"""The weight pool over three tiers (device, host, disk): which model is where, and who leaves.

- device: compute-ready weights of the models whose engines run (the CPU's device
  budget, or GPU memory); at most `cache_size` models and `device_bytes` bytes.
- host: `HostCopy`s in RAM (INT8 with `compression: int8`), LRU within `host_bytes`;
  a load from here skips the disk.
- disk: the model store (always there; eviction never deletes it).

Mechanism and bookkeeping only: the daemon asks `plan_device_load` whom to evict,
stops those engines itself and reports back with `device_loaded` / `device_evicted`.
Thread-safe: host copies are built off the event loop.

Shared bases (variants load only their delta): every full model's ModelWeights are registered here when built
(`shared_weights`), so a variant's engine reads the very same object as its
base's engine. A device entry counts its own bytes once: a base's under the
base, a variant's delta under the variant. A base whose engine leaves while
variants still use its weights stays on the device as a held entry
(`engine=False`, counted in bytes, not in cache_size) and goes with its last
variant; `plan_device_load` frees a base's bytes only when it and every variant
over it leave.

Several devices (`engine.devices`, routed by where a model is): one host tier, shared, and one device
tier per device, each with the same budget (`device_bytes` / cache_size). A
model is resident on at most one device at a time (`placement`; replicas are a
later step); `self.device` maps every resident model to its entry whatever its device, so
single-device callers need not know about placement. A variant runs where its base's
weights are. `plan_device_load(..., device=D)` plans D's tier alone;
`plan_options` plans every device at once for the router
(gpuservd/serving/routing.py `choose_device`). A load in progress reserves its bytes on
its device (`reserve`) so two cold requests arriving together do not both pick
the same empty device.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from gpuservd.errors import UserError
from gpuservd.weights.config import CacheConfig
from gpuservd.weights.host_tier import HostCopy

TIERS = ("device", "host")


@dataclass
class DeviceEntry:
    nbytes: int  # the model's own weight bytes (a variant: its delta only)
    pinned: bool
    last_used: float
    base: str | None = None  # a variant's base (its weights are the base's entry's)
    engine: bool = True  # an engine serves it; False: a base held only for its variants
    holders: set[str] = field(default_factory=set)  # variants on the device that use these weights


class CacheFull(UserError):
    """No model can leave the device now (all pinned, busy or kept alive).

    retry_after_s: when the first model in the way that is only kept alive may leave (None when every
    one in the way is pinned or busy: room comes when a request ends or an operator unpins)."""

    def __init__(self, message: str, retry_after_s: float | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class DevicePlan:
    """What loading a model onto one device would take: whom to evict and how many bytes they free."""

    device: str
    evict: list[str]
    evict_bytes: int


class WeightCache:
    def __init__(self, config: CacheConfig, device_budget: int, devices: list[str] | None = None):
        self.config = config
        self.device_budget = config.device_bytes or device_budget  # per device
        self.devices = list(devices or ["device"])
        self.device: dict[str, DeviceEntry] = {}
        self.placement: dict[str, str] = {}  # resident model -> the device that holds it
        self.reserved: dict[str, tuple[str, int]] = {}  # model loading -> (its device, bytes it will take)
        self.host: OrderedDict[str, HostCopy] = OrderedDict()  # least recently used first
        self.hits = {t: 0 for t in TIERS}
        self.misses = {t: 0 for t in TIERS}
        self.bytes_loaded = {"host": 0, "disk": 0}  # weight bytes read from each tier by loads
        self._lock = threading.Lock()
        self.weights: dict[str, object] = {}  # model -> its ModelWeights, shared with its variants
        self._build_locks: dict[str, threading.Lock] = {}

    # -- lookups (hit rates) -----------------------------------------------------
    def touch(self, model: str) -> bool:
        """A request for `model`: counts a device hit or miss; True if it is on the device."""
        with self._lock:
            entry = self.device.get(model)
            if entry is None:
                self.misses["device"] += 1
                return False
            self.hits["device"] += 1
            entry.last_used = time.monotonic()
            return True

    def host_copy(self, model: str) -> HostCopy | None:
        """The host tier's copy for a load (counts a host hit or miss)."""
        with self._lock:
            copy = self.host.get(model)
            if copy is None:
                self.misses["host"] += 1
                return None
            self.hits["host"] += 1
            self.host.move_to_end(model)
            return copy

    def hit_rate(self, tier: str = "device") -> float | None:
        n = self.hits[tier] + self.misses[tier]
        return self.hits[tier] / n if n else None

    # -- the device tier (LRU) ---------------------------------------------
    def device_of(self, model: str) -> str | None:
        """The device that holds model's weights (its engine's, or held for its variants), or None."""
        with self._lock:
            return self.placement.get(model) if model in self.device else None

    def plan_device_load(self, model: str, nbytes: int, busy: set[str], now: float | None = None,
                         device: str | None = None, kept: dict[str, float] | None = None) -> list[str]:
        """Models to evict (least recently used first) so `model` (nbytes) fits `device` (default:
        the first); raises UserError when it can never fit and CacheFull when everything in the way
        is pinned, busy or kept alive. kept: model -> seconds it is still kept alive from now (the
        daemon's view: its last request's keep_alive counted from when it went idle); without it,
        cache.keep_alive_s counted from each model's last lookup."""
        return self._plan(model, nbytes, busy, now, device or self.devices[0], kept).evict

    def plan_options(self, model: str, nbytes: int, busy: set[str], now: float | None = None,
                     kept: dict[str, float] | None = None) -> dict:
        """Per device: its DevicePlan, or the CacheFull that says why it cannot take `model` now
        (a model larger than the tier raises UserError: no device can ever take it)."""
        out: dict[str, DevicePlan | CacheFull] = {}
        for d in self.devices:
            try:
                out[d] = self._plan(model, nbytes, busy, now, d, kept)
            except CacheFull as exc:
                out[d] = exc
        return out

    def _kept_s(self, m: str, e: DeviceEntry, now: float, kept: dict[str, float] | None) -> float:
        """Seconds `m` is still kept alive (<= 0: it may be evicted). A negative keep_alive (forever)
        means no idle timer, not a guard: as in Ollama, such a model still makes room under pressure;
        only a pin holds a model against it."""
        if kept is not None:
            return kept.get(m, 0.0)
        return self.config.keep_alive_s - (now - e.last_used) if self.config.keep_alive_s > 0 else 0.0

    def _plan(self, model: str, nbytes: int, busy: set[str], now: float | None, device: str,
              kept: dict[str, float] | None = None) -> DevicePlan:
        now = time.monotonic() if now is None else now
        if nbytes > self.device_budget:
            raise UserError(f"model {model} needs {nbytes / 1e6:.1f} MB of weights but the device tier holds "
                            f"{self.device_budget / 1e6:.1f} MB; raise cache.device_bytes (or "
                            "engine.device_memory_bytes) or use a smaller dtype")
        with self._lock:
            others = {m: e for m, e in self.device.items()
                      if m != model and self.placement.get(m, self.devices[0]) == device}
            pending = [b for m, (d, b) in self.reserved.items() if m != model and d == device and m not in others]
            used = sum(e.nbytes for e in others.values()) + sum(pending)
            count = sum(e.engine for e in others.values()) + len(pending)
            used0 = used
            evict: list[str] = []

            def recency(item):  # a base is as recent as its most recent variant
                e = item[1]
                return max([e.last_used] + [others[h].last_used for h in e.holders if h in others])

            alive: list[float] = []  # seconds left of each kept-alive model passed over
            for m, e in sorted(others.items(), key=recency):
                if count + 1 <= self.config.cache_size and used + nbytes <= self.device_budget:
                    break
                if not e.engine or e.pinned or m in busy:
                    continue  # a held base leaves with its last variant, below
                left = self._kept_s(m, e, now, kept)
                if left > 0:
                    alive.append(left)
                    continue
                evict.append(m)
                count -= 1
                if not e.holders - set(evict):
                    used -= e.nbytes  # no variant keeps its weights
                be = others.get(e.base) if e.base else None
                if be is not None and not be.holders - set(evict) and (not be.engine or e.base in evict):
                    used -= be.nbytes  # the last user of a base that no engine serves any more
            if count + 1 > self.config.cache_size or used + nbytes > self.device_budget:
                held = ", ".join(sorted(others)) or "nothing"
                where = f"device {device}" if len(self.devices) > 1 else "the device"
                soonest = f"; the first keep_alive in the way ends in {min(alive):.0f} s" if alive else ""
                raise CacheFull(f"no room on {where} for model {model}: {held} are pinned, busy or kept "
                                f"alive (cache_size {self.config.cache_size}, {self.device_budget / 1e6:.0f} MB)"
                                f"{soonest}", min(alive) if alive else None)
            return DevicePlan(device, evict, used0 - used)

    def reserve(self, model: str, device: str, nbytes: int) -> None:
        """model's load onto device has begun: its bytes count there until it is loaded or fails."""
        with self._lock:
            self.reserved[model] = (device, nbytes)

    def device_loaded(self, model: str, nbytes: int, pinned: bool = False, base: str | None = None,
                      device: str | None = None) -> None:
        """`model`'s engine serves on `device` (default: the first); nbytes are its own (a variant's
        delta, whose base is held there)."""
        with self._lock:
            self.reserved.pop(model, None)
            self.placement[model] = device or self.placement.get(model) or self.devices[0]
            old = self.device.get(model)
            holders = old.holders if old is not None else set()
            self.device[model] = DeviceEntry(nbytes, pinned, time.monotonic(), base, True, holders)
            if base is not None and base in self.device:
                self.device[base].holders.add(model)

    def hold_base(self, base: str, nbytes: int, holder: str, device: str | None = None) -> None:
        """A variant (holder) uses base's weights: the base is on the device (the holder's), with or
        without its own engine, until its last holder leaves."""
        with self._lock:
            entry = self.device.get(base)
            if entry is None:
                entry = self.device[base] = DeviceEntry(nbytes, False, time.monotonic(), engine=False)
                self.placement[base] = device or self.reserved.get(holder, (self.devices[0],))[0]
            entry.holders.add(holder)

    def claim(self, model: str) -> None:
        """model's own engine is being built over weights held for its variants: they stay when
        those variants leave meanwhile (its load failing gives them up, through device_evicted)."""
        with self._lock:
            entry = self.device.get(model)
            if entry is not None:
                entry.engine = True

    def device_evicted(self, model: str) -> None:
        """model's engine left (or its load failed): its weights go unless variants still use them,
        and a base it held goes too when no engine and no other variant uses it."""
        with self._lock:
            self.reserved.pop(model, None)
            entry = self.device.get(model)
            if entry is not None and entry.holders:
                entry.engine = False
                entry.pinned = False
            else:
                self.device.pop(model, None)
                self.placement.pop(model, None)
                self.weights.pop(model, None)
            for name, e in list(self.device.items()):
                if model in e.holders:
                    e.holders.discard(model)
                    if not e.holders and not e.engine:
                        self.device.pop(name)
                        self.placement.pop(name, None)
                        self.weights.pop(name, None)

    def shared_weights(self, model: str, build):
        """model's weights in memory: the ones already there (its engine's, or held for its
        variants), else build() -> weights, kept for every engine that asks next. One build at a
        time per model, so two variants asking for one base load it once."""
        with self._lock:
            lock = self._build_locks.setdefault(model, threading.Lock())
        with lock:
            with self._lock:
                if model in self.weights:
                    return self.weights[model]
            weights = build()
            with self._lock:
                self.weights[model] = weights
            return weights

    def has_weights(self, model: str) -> bool:
        with self._lock:
            return model in self.weights

    def set_pinned(self, model: str, pinned: bool) -> None:
        with self._lock:
            if model in self.device:
                self.device[model].pinned = pinned

    # -- the host tier ----------------------------------------------------
    def keep_host_copy(self, model: str, reader, compression: str | None = None) -> HostCopy | None:
        """Build and keep a host copy of `model` from `reader`, evicting least recently used copies
        to fit; None when it would not fit in host_bytes at all (the disk tier serves it)."""
        with self._lock:
            if model in self.host:
                return self.host[model]
        copy = HostCopy.from_reader(model, reader, compression=compression or self.config.compression)
        with self._lock:
            if copy.nbytes > self.config.host_bytes:
                return None
            while self.host and sum(c.nbytes for c in self.host.values()) + copy.nbytes > self.config.host_bytes:
                self.host.popitem(last=False)
            self.host[model] = copy
            return copy

    # -- reporting --------------------------------------------------------
    def residency(self, model: str) -> dict:
        with self._lock:
            dev = self.device.get(model)
            host = self.host.get(model)
            return {"device": dev.nbytes if dev else 0, "host": host.nbytes if host else 0,
                    "host_compression": host.compression if host else None,
                    "device_name": self.placement.get(model) if dev else None}

    def _device_status(self, device: str) -> dict:
        """One device's tier (the lock held)."""
        on = {m: e for m, e in self.device.items() if self.placement.get(m, self.devices[0]) == device}
        return {"budget_bytes": self.device_budget, "used_bytes": sum(e.nbytes for e in on.values()),
                "reserved_bytes": sum(b for d, b in self.reserved.values() if d == device),
                "models": sorted(on), "cache_size": self.config.cache_size}

    def counters(self) -> dict:
        """What /metrics reads of status(): lookups per tier and the bytes each tier holds."""
        with self._lock:
            return {"hits": dict(self.hits), "misses": dict(self.misses),
                    "used_bytes": {"device": sum(e.nbytes for e in self.device.values()),
                                   "host": sum(c.nbytes for c in self.host.values())}}

    def status(self) -> dict:
        with self._lock:
            return {
                "device": {"budget_bytes": self.device_budget, "used_bytes": sum(e.nbytes for e in self.device.values()),
                           "models": sorted(self.device), "cache_size": self.config.cache_size,
                           # base -> the variants on the device that share its weights
                           "shared_bases": {m: sorted(e.holders) for m, e in sorted(self.device.items()) if e.holders},
                           "held_bases": sorted(m for m, e in self.device.items() if not e.engine)},
                "host": {"budget_bytes": self.config.host_bytes,
                         "used_bytes": sum(c.nbytes for c in self.host.values()), "models": list(self.host),
                         "compression": self.config.compression},
                "devices": {d: self._device_status(d) for d in self.devices},
                "hits": dict(self.hits), "misses": dict(self.misses),
                "hit_rate": {t: self.hit_rate(t) for t in TIERS},
                "bytes_loaded": dict(self.bytes_loaded),
                "policy": self.config.cache_policy, "load_strategy": self.config.load_strategy,
            }

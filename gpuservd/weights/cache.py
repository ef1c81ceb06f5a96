"""The weight pool over three tiers (M1, M7, M9): which model is where, and who leaves.

- device: compute-ready weights of the models whose engines run (the CPU's device
  budget, or GPU memory); at most `cache_size` models and `device_bytes` bytes.
- host: `HostCopy`s in RAM (INT8 with `compression: int8`), LRU within `host_bytes`;
  a load from here skips the disk.
- disk: the model store (always there; eviction never deletes it).

Mechanism and bookkeeping only: the daemon asks `plan_device_load` whom to evict,
stops those engines itself and reports back with `device_loaded` / `device_evicted`.
Thread-safe: host copies are built off the event loop.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from gpuservd.errors import UserError
from gpuservd.weights.config import CacheConfig
from gpuservd.weights.host_tier import HostCopy

TIERS = ("device", "host")


@dataclass
class DeviceEntry:
    nbytes: int
    pinned: bool
    last_used: float


class CacheFull(UserError):
    """No model can leave the device now (all pinned, busy or kept alive)."""


class WeightCache:
    def __init__(self, config: CacheConfig, device_budget: int):
        self.config = config
        self.device_budget = config.device_bytes or device_budget
        self.device: dict[str, DeviceEntry] = {}
        self.host: OrderedDict[str, HostCopy] = OrderedDict()  # least recently used first
        self.hits = {t: 0 for t in TIERS}
        self.misses = {t: 0 for t in TIERS}
        self.bytes_loaded = {"host": 0, "disk": 0}  # weight bytes read from each tier by loads
        self._lock = threading.Lock()

    # -- lookups (M9) -----------------------------------------------------
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

    # -- the device tier (M7) ---------------------------------------------
    def plan_device_load(self, model: str, nbytes: int, busy: set[str], now: float | None = None) -> list[str]:
        """Models to evict (least recently used first) so `model` (nbytes) fits; raises UserError
        when it can never fit and CacheFull when everything in the way is pinned, busy or kept alive."""
        now = time.monotonic() if now is None else now
        if nbytes > self.device_budget:
            raise UserError(f"model {model} needs {nbytes / 1e6:.1f} MB of weights but the device tier holds "
                            f"{self.device_budget / 1e6:.1f} MB; raise cache.device_bytes (or "
                            "engine.device_memory_bytes) or use a smaller dtype")
        with self._lock:
            others = {m: e for m, e in self.device.items() if m != model}
            used = sum(e.nbytes for e in others.values())
            count = len(others)
            evict: list[str] = []
            for m, e in sorted(others.items(), key=lambda kv: kv[1].last_used):
                if count + 1 <= self.config.cache_size and used + nbytes <= self.device_budget:
                    break
                if e.pinned or m in busy or now - e.last_used < self.config.keep_alive_s:
                    continue
                evict.append(m)
                used -= e.nbytes
                count -= 1
            if count + 1 > self.config.cache_size or used + nbytes > self.device_budget:
                held = ", ".join(sorted(others)) or "nothing"
                raise CacheFull(f"no room on the device for model {model}: {held} are pinned, busy or kept "
                                f"alive (cache_size {self.config.cache_size}, {self.device_budget / 1e6:.0f} MB)")
            return evict

    def device_loaded(self, model: str, nbytes: int, pinned: bool = False) -> None:
        with self._lock:
            self.device[model] = DeviceEntry(nbytes, pinned, time.monotonic())

    def device_evicted(self, model: str) -> None:
        with self._lock:
            self.device.pop(model, None)

    def set_pinned(self, model: str, pinned: bool) -> None:
        with self._lock:
            if model in self.device:
                self.device[model].pinned = pinned

    # -- the host tier ----------------------------------------------------
    def keep_host_copy(self, model: str, reader) -> HostCopy | None:
        """Build and keep a host copy of `model` from `reader`, evicting least recently used copies
        to fit; None when it would not fit in host_bytes at all (the disk tier serves it)."""
        with self._lock:
            if model in self.host:
                return self.host[model]
        copy = HostCopy.from_reader(model, reader, compression=self.config.compression)
        with self._lock:
            if copy.nbytes > self.config.host_bytes:
                return None
            while self.host and sum(c.nbytes for c in self.host.values()) + copy.nbytes > self.config.host_bytes:
                self.host.popitem(last=False)
            self.host[model] = copy
            return copy

    def drop_host_copy(self, model: str) -> None:
        with self._lock:
            self.host.pop(model, None)

    # -- reporting --------------------------------------------------------
    def residency(self, model: str) -> dict:
        with self._lock:
            dev = self.device.get(model)
            host = self.host.get(model)
            return {"device": dev.nbytes if dev else 0, "host": host.nbytes if host else 0,
                    "host_compression": host.compression if host else None}

    def status(self) -> dict:
        with self._lock:
            return {
                "device": {"budget_bytes": self.device_budget, "used_bytes": sum(e.nbytes for e in self.device.values()),
                           "models": sorted(self.device), "cache_size": self.config.cache_size},
                "host": {"budget_bytes": self.config.host_bytes,
                         "used_bytes": sum(c.nbytes for c in self.host.values()), "models": list(self.host),
                         "compression": self.config.compression},
                "hits": dict(self.hits), "misses": dict(self.misses),
                "hit_rate": {t: self.hit_rate(t) for t in TIERS},
                "bytes_loaded": dict(self.bytes_loaded),
                "policy": self.config.cache_policy, "load_strategy": self.config.load_strategy,
            }

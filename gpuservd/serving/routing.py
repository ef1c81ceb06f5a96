"""Routing: which version serves a request (versions side by side, canary
weights), and which device a model loads on (cache-aware: where it already is).

Devices (cache-aware routing). With several devices (`engine.devices`:
cuda:0..N, or CPU device slots cpu:0..N) a model is resident on at most one
of them (replicas are a later step). A request for a model resident on D goes
to D: a hit, nothing moves. Otherwise the load goes to the least-bad device,
`choose_device` below: a device that needs no eviction beats one that does;
among those, fewer bytes to evict, then fewer models evicted (pinned and busy
models are never candidates: a device that could only make room by evicting
them cannot take the model now), then the device's current load (requests in
flight and queued on its models, plus loads under way), then its index in
engine.devices. A pure function over `DeviceOption`s, so each rule is unit
tested (tests/test_routing.py); `pick_plan` builds the options from the weight
cache's per-device plans.

Versions. A model name can stand for several versions.

`server.versions: {alias: {version: weight}}` (or POST /admin/models/ALIAS/versions
at run time) splits an alias's traffic by weight, for example 90/10 between the
current model and a canary. Each request picks one version at random in
proportion to the weights; the response's `model` field names the version that
served it, and status counts what each version served. A name without a
version table is served as itself.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, field

from gpuservd.errors import UserError


def check_weights(alias: str, weights) -> dict[str, float]:
    """Validate {version: weight}; raises UserError naming what to fix."""
    if not isinstance(weights, dict) or not weights:
        raise UserError(f"versions of {alias!r} must be a mapping of version name to weight, got {weights!r}")
    out: dict[str, float] = {}
    for v, w in weights.items():
        if not isinstance(v, str) or not v:
            raise UserError(f"versions of {alias!r}: version names must be non-empty strings, got {v!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
            raise UserError(f"versions of {alias!r}: the weight of {v!r} must be a number >= 0, got {w!r}")
        out[v] = float(w)
    if sum(out.values()) <= 0:
        raise UserError(f"versions of {alias!r}: at least one weight must be above 0")
    return out


class VersionRouter:
    def __init__(self, table: dict | None = None, seed: int | None = None):
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.table: dict[str, dict[str, float]] = {}
        self.served: dict[str, dict[str, int]] = {}
        for alias, weights in (table or {}).items():
            self.set(alias, weights)

    def set(self, alias: str, weights: dict | None) -> dict:
        """Replace an alias's weights (None or {} removes the alias); returns its new entry."""
        with self._lock:
            if not weights:
                self.table.pop(alias, None)
                return {"model": alias, "versions": {}}
            self.table[alias] = check_weights(alias, weights)
            self.served.setdefault(alias, {})
            return {"model": alias, "versions": dict(self.table[alias])}

    def pick(self, name: str) -> str:
        """The version that serves a request for `name` (itself when it has no version table)."""
        with self._lock:
            weights = self.table.get(name)
            if not weights:
                return name
            names = [v for v, w in weights.items() if w > 0]
            version = self._rng.choices(names, [weights[v] for v in names])[0]
            counts = self.served.setdefault(name, {})
            counts[version] = counts.get(version, 0) + 1
            return version

    def status(self) -> dict:
        with self._lock:
            return {alias: {"weights": dict(w), "served": dict(self.served.get(alias, {}))}
                    for alias, w in self.table.items()}


@dataclass
class DeviceOption:
    """One device as a place to load a model: feasible (it can make room now), whom it would evict,
    the bytes they free, and the device's current load."""

    device: str
    index: int  # its position in engine.devices (the last tie-break)
    feasible: bool = True
    evict: list[str] = field(default_factory=list)
    evict_bytes: int = 0
    load: int = 0  # requests in flight and queued on its models, plus loads under way
    reason: str = ""  # why it is not feasible

    def cost(self) -> tuple:
        return (bool(self.evict), self.evict_bytes, len(self.evict), self.load, self.index)


def choose_device(options: list[DeviceOption], resident: str | None = None) -> DeviceOption | None:
    """The device a model goes to: the one that holds it (resident), else the least-bad feasible
    option by (needs eviction, bytes evicted, models evicted, load, index); None when none can take it."""
    if resident is not None:
        for o in options:
            if o.device == resident:
                return o
    feasible = [o for o in options if o.feasible]
    return min(feasible, key=DeviceOption.cost) if feasible else None


def pick_plan(plans: dict, resident: str | None, load: dict[str, int]):
    """The plan of the device a model loads on, from the weight cache's per-device plans (device ->
    a DevicePlan, or the CacheFull error saying why that device cannot make room now): the device that
    holds its weights (or its base's), else `choose_device`. Raises the CacheFull when no device can."""
    infeasible = {d: p for d, p in plans.items() if isinstance(p, Exception)}
    options = [DeviceOption(d, i, d not in infeasible, [] if d in infeasible else p.evict,
                            0 if d in infeasible else p.evict_bytes, load.get(d, 0), str(infeasible.get(d, "")))
               for i, (d, p) in enumerate(plans.items())]
    choice = choose_device(options, resident)
    if choice is None or not choice.feasible:
        full = list(infeasible.values())
        if resident is not None or len(full) == 1:
            raise plans[resident] if resident is not None else full[0]
        waits = [p.retry_after_s for p in full if p.retry_after_s is not None]  # the soonest keep_alive to end
        raise type(full[0])("; ".join(str(p) for p in full), min(waits) if waits else None)
    return plans[choice.device]

"""Model versions and canary routing (O4): a model name can stand for several versions.

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

    def versions_of(self, name: str) -> list[str]:
        with self._lock:
            return list(self.table.get(name, {}))

    def status(self) -> dict:
        with self._lock:
            return {alias: {"weights": dict(w), "served": dict(self.served.get(alias, {}))}
                    for alias, w in self.table.items()}

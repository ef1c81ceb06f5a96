"""The workload file's schema: its parts as dataclasses, and their validation.

Split from workload.py to keep both small. Every check raises a `UserError`
whose single line reads ``FILE: FIELD.PATH: what is expected, got VALUE``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpuservd.errors import UserError

DISTS = {"fixed": ("value",), "uniform": ("min", "max"), "lognormal": ("median", "sigma", "min", "max")}
PROCESSES = ("burst", "poisson", "trace")
SHARE_TOLERANCE = 1e-6  # shares must sum to 1 within this


@dataclass(frozen=True)
class Where:
    """A place in a workload file, for error messages."""

    file: Path | None  # the file being read
    path: str  # field path, e.g. "classes[1].output_tokens.median"

    def at(self, key: str | int) -> Where:
        """The child field `key` (a name, or an index into a list)."""
        if isinstance(key, int):
            return Where(self.file, f"{self.path}[{key}]")
        return Where(self.file, f"{self.path}.{key}" if self.path else key)

    def error(self, what: str) -> UserError:
        """A one-line UserError naming the file and this field."""
        where = f"{self.path}: " if self.path else ""
        return UserError(f"{self.file}: {where}{what}")


@dataclass
class LengthDist:
    """A token-length distribution; every sample is an integer >= 1."""

    dist: str  # "fixed", "uniform" or "lognormal"
    value: int | None = None  # fixed: the length
    min: int | None = None  # uniform: lowest (inclusive); lognormal: clip floor
    max: int | None = None  # uniform: highest (inclusive); lognormal: clip ceiling
    median: float | None = None  # lognormal: median length
    sigma: float | None = None  # lognormal: sigma of the underlying normal

    def sample(self, rng: np.random.Generator) -> int:
        """One length drawn from the distribution."""
        if self.dist == "fixed":
            return int(self.value)
        if self.dist == "uniform":
            return int(rng.integers(self.min, self.max + 1))
        x = self.median * math.exp(self.sigma * rng.standard_normal())
        return int(min(max(round(x), self.min or 1), self.max if self.max is not None else x))


@dataclass
class RequestClass:
    """A kind of request in the mix."""

    name: str  # class name; the report breaks latency down by it
    share: float  # fraction of the requests (shares sum to 1)
    prompt_tokens: LengthDist  # prompt length distribution
    output_tokens: LengthDist  # forced output length distribution
    priority: int = 0  # default priority of its requests
    tenant: str = "default"  # default tenant of its requests
    prefix_tokens: int = 0  # tokens of a system prompt every request of the class starts with (bench/chat.py)
    turns: int = 1  # turns per conversation; each turn resends the history (bench/chat.py)


@dataclass
class Arrival:
    """When requests are submitted."""

    process: str  # "burst" (all at 0), "poisson" (rate) or "trace" (path)
    rate: float | None = None  # poisson: mean requests per second
    path: str | None = None  # trace: JSONL path as written in the file
    trace_path: Path | None = None  # trace: the path resolved against the workload file's folder


def _check_keys(d: dict, where: Where, required: tuple, optional: tuple = ()) -> None:
    unknown = sorted(str(k) for k in d if k not in required + optional)
    if unknown:
        allowed = ", ".join(required + optional)
        raise where.error(f"unknown field(s) {', '.join(unknown)}; expected {allowed}")
    for k in required:
        if k not in d:
            raise where.at(k).error("missing")


def _mapping(v, where: Where, example: str) -> dict:
    if not isinstance(v, dict):
        raise where.error(f"expected a mapping like {example}, got {v!r}")
    return v


def _int(v, where: Where, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
        bound = f" >= {lo}" if lo is not None else ""
        raise where.error(f"expected an integer{bound}, got {v!r}")
    return v


def _number(v, where: Where, positive: bool = False, nonneg: bool = False) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    if not ok or (positive and v <= 0) or (nonneg and v < 0):
        bound = " > 0" if positive else " >= 0" if nonneg else ""
        raise where.error(f"expected a number{bound}, got {v!r}")
    return float(v)


def _name(v, where: Where) -> str:
    if not isinstance(v, str) or not v.strip():
        raise where.error(f"expected a non-empty string, got {v!r}")
    return v


def parse_dist(v, where: Where) -> LengthDist:
    """A `{dist: ..., ...}` mapping as a LengthDist."""
    d = _mapping(v, where, "{dist: uniform, min: 16, max: 64}")
    kind = d.get("dist")
    if kind not in DISTS:
        raise where.at("dist").error(f"expected one of {', '.join(DISTS)}, got {kind!r}")
    if kind == "lognormal":
        _check_keys(d, where, ("dist", "median", "sigma"), ("min", "max"))
        lo = _int(d.get("min", 1), where.at("min"), 1)
        hi = _int(d["max"], where.at("max"), 1) if "max" in d else None
        out = LengthDist(kind, min=lo, max=hi, median=_number(d["median"], where.at("median"), positive=True),
                         sigma=_number(d["sigma"], where.at("sigma"), nonneg=True))
    else:
        _check_keys(d, where, ("dist",) + DISTS[kind])
        if kind == "fixed":
            return LengthDist(kind, value=_int(d["value"], where.at("value"), 1))
        lo, hi = _int(d["min"], where.at("min"), 1), _int(d["max"], where.at("max"), 1)
        out = LengthDist(kind, min=lo, max=hi)
    if out.max is not None and out.max < out.min:
        raise where.at("max").error(f"expected max >= min ({out.min}), got {out.max}")
    return out


def parse_class(v, where: Where) -> RequestClass:
    """One `classes[i]` entry."""
    d = _mapping(v, where, "{name: short, share: 0.5, prompt_tokens: {...}, output_tokens: {...}}")
    _check_keys(d, where, ("name", "share", "prompt_tokens", "output_tokens"),
                ("priority", "tenant", "prefix_tokens", "turns"))
    share = _number(d["share"], where.at("share"), nonneg=True)
    if share > 1:
        raise where.at("share").error(f"expected a fraction between 0 and 1, got {d['share']!r}")
    return RequestClass(
        name=_name(d["name"], where.at("name")),
        share=share,
        prompt_tokens=parse_dist(d["prompt_tokens"], where.at("prompt_tokens")),
        output_tokens=parse_dist(d["output_tokens"], where.at("output_tokens")),
        priority=_int(d.get("priority", 0), where.at("priority")),
        tenant=_name(d.get("tenant", "default"), where.at("tenant")),
        prefix_tokens=_int(d.get("prefix_tokens", 0), where.at("prefix_tokens"), 0),
        turns=_int(d.get("turns", 1), where.at("turns"), 1),
    )


def parse_arrival(v, where: Where, file: Path) -> Arrival:
    """The `arrival` mapping; a trace path is resolved against the workload file's folder."""
    d = _mapping(v, where, "{process: burst}")
    process = d.get("process")
    if process not in PROCESSES:
        raise where.at("process").error(f"expected one of {', '.join(PROCESSES)}, got {process!r}")
    if process == "burst":
        _check_keys(d, where, ("process",))
        return Arrival(process)
    if process == "poisson":
        _check_keys(d, where, ("process", "rate"))
        return Arrival(process, rate=_number(d["rate"], where.at("rate"), positive=True))
    _check_keys(d, where, ("process", "path"))
    rel = _name(d["path"], where.at("path"))
    return Arrival(process, path=rel, trace_path=(file.parent / rel).resolve())


def parse_workload_dict(data, file: Path) -> dict:
    """Validate a loaded workload YAML document; returns the Workload constructor fields."""
    root = Where(file, "")
    if not isinstance(data, dict):
        raise root.error(f"expected a mapping with name, model, seed, requests, arrival, classes; got {type(data).__name__}")
    _check_keys(data, root, ("name", "model", "arrival"), ("seed", "requests", "classes"))
    arrival = parse_arrival(data["arrival"], root.at("arrival"), file)
    is_trace = arrival.process == "trace"
    if "requests" in data or not is_trace:
        if "requests" not in data:
            raise root.at("requests").error("missing; expected the number of requests (an integer >= 1)")
        requests = _int(data["requests"], root.at("requests"), 1)
    else:
        requests = None
    raw_classes = data.get("classes", [])
    if raw_classes is None or (not is_trace and not raw_classes):
        raise root.at("classes").error("expected a non-empty list of request classes")
    if not isinstance(raw_classes, list):
        raise root.at("classes").error(f"expected a list of request classes, got {raw_classes!r}")
    classes = [parse_class(c, root.at("classes").at(i)) for i, c in enumerate(raw_classes)]
    seen = set()
    for i, c in enumerate(classes):
        if c.name in seen:
            raise root.at("classes").at(i).at("name").error(f"duplicate class name {c.name!r}")
        seen.add(c.name)
    total = sum(c.share for c in classes)
    if classes and abs(total - 1.0) > SHARE_TOLERANCE:
        raise root.at("classes").error(f"shares must sum to 1, got {total:g}")
    return dict(
        name=_name(data["name"], root.at("name")),
        model=_name(data["model"], root.at("model")),
        seed=_int(data.get("seed", 0), root.at("seed"), 0),
        requests=requests,
        arrival=arrival,
        classes=classes,
    )

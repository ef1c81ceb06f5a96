"""Benchmark workloads: YAML files in profiles/workloads/, validated and materialized.

Users write their own workload files, so every mistake is a `UserError` whose
one line names the file, the field path (``classes[1].output_tokens.median``)
and what is expected. `materialize()` turns a workload into concrete requests;
it is deterministic given the seed, so every system in a benchmark run (and
every rerun) sees the same prompts, lengths and arrival times.

Randomness comes from independent child streams of one `SeedSequence` (class
assignment, arrivals, lengths, token ids), so changing, say, the arrival
process leaves the lengths and prompts as they were.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from gpuservd.bench.chat import build_chats
from gpuservd.bench.workload_schema import (
    Arrival,
    LengthDist,
    RequestClass,
    Where,
    parse_workload_dict,
)
from gpuservd.errors import UserError

__all__ = ["Arrival", "LengthDist", "RequestClass", "Workload", "WorkloadRequest", "load_workload"]


@dataclass
class WorkloadRequest:
    """One concrete request of a materialized workload."""

    request_id: str  # stable id, the same in every system's run
    cls: str  # request class name
    arrival_s: float  # submit offset from the run start, seconds
    prompt_token_ids: list[int]  # the prompt, already tokenized
    output_tokens: int  # forced output length (ignore EOS)
    priority: int = 0  # larger = more important (used by the scheduling issues)
    tenant: str = "default"  # who sent it (used by the quota issues)
    model: str = ""  # model name in the store


@dataclass
class Workload:
    """A validated workload file."""

    name: str  # workload name (from the file)
    model: str  # default model name for its requests
    seed: int  # seeds every random choice in materialize()
    requests: int | None  # number of requests; with a trace, the most to read (None = all)
    arrival: Arrival  # when requests are submitted
    classes: list[RequestClass] = field(default_factory=list)  # request classes (optional with a trace)
    path: Path | None = None  # the file it came from, for messages and the report

    def class_names(self) -> list[str]:
        """Class names in file order; with a trace and no classes, in order of first appearance."""
        names = [c.name for c in self.classes]
        if self.arrival.process == "trace":
            for line in self._read_trace():
                if line["class"] not in names:
                    names.append(line["class"])
        return names

    def materialize(
        self,
        tokenizer_vocab_size: int,
        eos_token_id: int | list[int] | None = None,
        tokenize: Callable[[str], list[int]] | None = None,
    ) -> list[WorkloadRequest]:
        """Concrete requests in arrival order. Prompt token ids are random ids that avoid the
        low (usually special) ids and EOS; `tokenize` is needed only for trace lines with `prompt` text."""
        # A fifth stream for chats: the first four draw the same numbers whether or not a workload has
        # chats, so a workload without chats keeps its requests (and its results stay comparable).
        streams = np.random.SeedSequence(self.seed).spawn(5)
        rng_cls, rng_arrival, rng_len, rng_tok, rng_chat = (np.random.default_rng(s) for s in streams)
        if self.arrival.process == "trace":
            specs = self._trace_specs(rng_len, tokenize)
        else:
            n = int(self.requests or 0)
            names = _assign_classes(self.classes, n, rng_cls)
            by_name = {c.name: c for c in self.classes}
            arrivals = _arrivals(self.arrival, n, rng_arrival)
            specs = []
            for i, name in enumerate(names):
                c = by_name[name]
                specs.append(
                    dict(t=arrivals[i], cls=name, prompt_tokens=c.prompt_tokens.sample(rng_len),
                         output_tokens=c.output_tokens.sample(rng_len), priority=c.priority,
                         tenant=c.tenant, model=self.model, prompt_ids=None)
                )
        eos = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
        build_chats(specs, {c.name: c for c in self.classes}, rng_chat,
                    lambda rng, n: _random_prompt(rng, n, tokenizer_vocab_size, eos))
        out = []
        for i, s in enumerate(specs):
            ids = s["prompt_ids"]
            if ids is None:
                ids = _random_prompt(rng_tok, s["prompt_tokens"], tokenizer_vocab_size, eos)
            out.append(
                WorkloadRequest(
                    request_id=f"req-{i:04d}", cls=s["cls"], arrival_s=float(s["t"]),
                    prompt_token_ids=ids, output_tokens=int(s["output_tokens"]),
                    priority=int(s["priority"]), tenant=str(s["tenant"]), model=s["model"],
                )
            )
        return out

    # -- traces ---------------------------------------------------------------

    def _read_trace(self) -> list[dict]:
        """Validated trace lines (at most `requests`), sorted by time (stable)."""
        trace = self.arrival.trace_path
        assert trace is not None
        where = Where(self.path, "arrival.path")
        if not trace.is_file():
            raise where.error(f"trace file {trace} does not exist (the path is relative to the workload file)")
        lines = []
        with trace.open() as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                if self.requests is not None and len(lines) >= self.requests:
                    break
                lines.append(_parse_trace_line(raw, Where(trace, f"line {lineno}"), self))
        if not lines:
            raise where.error(f"trace file {trace} has no requests")
        lines.sort(key=lambda d: d["t"])
        return lines

    def _trace_specs(self, rng_len: np.random.Generator, tokenize) -> list[dict]:
        by_name = {c.name: c for c in self.classes}
        specs = []
        for line in self._read_trace():
            c = by_name.get(line["class"])
            prompt_ids = None
            if line.get("prompt") is not None:
                if tokenize is None:
                    raise UserError(f"{line['where']}: prompt: text prompts need a tokenizer here; use prompt_tokens")
                prompt_ids = list(tokenize(line["prompt"]))
            n_prompt = line.get("prompt_tokens")
            n_out = line.get("output_tokens")
            # A line may leave its lengths to its class's distributions.
            if n_prompt is None and prompt_ids is None:
                n_prompt = c.prompt_tokens.sample(rng_len)
            if n_out is None:
                n_out = c.output_tokens.sample(rng_len)
            specs.append(
                dict(t=line["t"], cls=line["class"], prompt_tokens=n_prompt, output_tokens=n_out,
                     priority=line.get("priority", c.priority if c else 0),
                     tenant=line.get("tenant", c.tenant if c else "default"),
                     model=line.get("model", self.model), prompt_ids=prompt_ids)
            )
        return specs


def _parse_trace_line(raw: str, where: Where, wl: Workload) -> dict:
    """One JSONL line, validated; `where` names the trace file and line."""
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as e:
        raise where.error(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(d, dict):
        raise where.error("expected a JSON object like {\"t\": 0.1, \"prompt_tokens\": 40, \"output_tokens\": 32}")
    known = {"t", "model", "class", "prompt_tokens", "prompt", "output_tokens", "priority", "tenant"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise where.error(f"unknown field(s) {', '.join(unknown)}; expected {', '.join(sorted(known))}")
    t = d.get("t")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise where.at("t").error(f"expected a time in seconds >= 0, got {t!r}")
    if "class" not in d and len(wl.classes) > 1:
        names = ", ".join(c.name for c in wl.classes)
        raise where.at("class").error(f"missing; the workload defines several classes: {names}")
    cls = d.get("class", wl.classes[0].name if wl.classes else "default")
    if not isinstance(cls, str) or not cls:
        raise where.at("class").error(f"expected a class name, got {cls!r}")
    has_class = any(c.name == cls for c in wl.classes)
    if wl.classes and not has_class:
        names = ", ".join(c.name for c in wl.classes)
        raise where.at("class").error(f"unknown class {cls!r}; the workload defines {names}")
    out = {"t": float(t), "class": cls, "where": f"{where.file}: {where.path}"}
    if "prompt" in d and "prompt_tokens" in d:
        raise where.error("give either prompt (text) or prompt_tokens (a count), not both")
    if "prompt" in d:
        if not isinstance(d["prompt"], str) or not d["prompt"]:
            raise where.at("prompt").error(f"expected non-empty text, got {d['prompt']!r}")
        out["prompt"] = d["prompt"]
    for key in ("prompt_tokens", "output_tokens"):
        if key in d:
            v = d[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise where.at(key).error(f"expected an integer >= 1, got {v!r}")
            out[key] = v
        elif not has_class and not (key == "prompt_tokens" and "prompt" in out):
            raise where.at(key).error("missing; expected an integer >= 1 (or a class whose distribution fills it)")
    if "priority" in d:
        if isinstance(d["priority"], bool) or not isinstance(d["priority"], int):
            raise where.at("priority").error(f"expected an integer, got {d['priority']!r}")
        out["priority"] = d["priority"]
    for key in ("tenant", "model"):
        if key in d:
            if not isinstance(d[key], str) or not d[key]:
                raise where.at(key).error(f"expected a non-empty string, got {d[key]!r}")
            out[key] = d[key]
    return out


# -- generation helpers ---------------------------------------------------------


def _assign_classes(classes: list[RequestClass], n: int, rng: np.random.Generator) -> list[str]:
    """Exact counts by share, shuffled. Counts are rounded half up; a shortfall goes to the
    largest share, an excess (ties rounded up) is taken back from the smallest share first."""
    counts = [math.floor(n * c.share + 0.5) for c in classes]
    largest_first = sorted(range(len(classes)), key=lambda i: -classes[i].share)  # stable: file order on ties
    remainder = n - sum(counts)
    order = largest_first if remainder > 0 else largest_first[::-1]
    k = 0
    while remainder != 0:
        i = order[k % len(order)]
        step = 1 if remainder > 0 else -1
        if counts[i] + step >= 0:
            counts[i] += step
            remainder -= step
        k += 1
    names = [c.name for c, m in zip(classes, counts) for _ in range(m)]
    rng.shuffle(names)
    return names


def _arrivals(arrival: Arrival, n: int, rng: np.random.Generator) -> list[float]:
    """Submit offsets: burst = all at 0; poisson = first at 0, then exponential gaps of mean 1/rate."""
    if arrival.process == "burst":
        return [0.0] * n
    gaps = rng.exponential(1.0 / float(arrival.rate), size=max(n - 1, 0))
    return [0.0] + np.cumsum(gaps).tolist()


def _random_prompt(rng: np.random.Generator, n: int, vocab_size: int, eos: set) -> list[int]:
    """n random token ids from [100, vocab - 1): low ids are usually special tokens; EOS is redrawn."""
    lo = 100 if vocab_size > 200 else 1
    hi = max(vocab_size - 1, lo + 1)
    ids = rng.integers(lo, hi, size=n).tolist()
    for j, t in enumerate(ids):
        while t in eos:
            t = int(rng.integers(lo, hi))
        ids[j] = t
    return ids


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload YAML file; every problem is a one-line `UserError`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"workload file not found: {path}")
    if path.suffix == ".jsonl":  # a bare trace (e.g. from `gpuserv record`): replay it as recorded
        from gpuservd.bench.record import trace_workload  # here: record.py imports this module

        wl = trace_workload(path)
        wl._read_trace()
        return wl
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise UserError(f"{path}: not valid YAML{at}: {problem}") from None
    fields = parse_workload_dict(data, path)
    wl = Workload(path=path, **fields)
    if wl.arrival.process == "trace":
        wl._read_trace()  # validate the trace now, not half way into a benchmark
    return wl

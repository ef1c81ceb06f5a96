"""Every event the daemon publishes, as a dataclass with one `type` and a stable JSON shape.

The engine, the models, serving, the arbiter and the hints make these; the bus carries them;
`/admin/events` sends `to_json()` of each, one JSON object per line; readers (the console,
`gpuserv record` and `gpuserv events`) turn a line back into its class with `read_event`.

JSON shape, schema 2 (the `hello` line says `"schema": 2`): `{"type": ..., "t":
..., <the fields below, in order>}`; shape.py says how (optional fields, keys a
reader does not know passed through in `extra`).

Schema 1 (a `hello` without `schema`; the console's replay fixtures) named a preemption
victim's move and a KV copy's direction only by `"kind"` (`"swap"`, `"swap_out"`), and the
engine's own events nested in a step record had `"kind"` where every other event has `"type"`.
Schema 2 adds `move` and `direction`, keeps `kind` beside them for schema-1 readers, and
`read_event` reads both shapes.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from gpuservd.events.shape import JsonShape, optional, parse_list, upgrade

SCHEMA_VERSION = 2

_TYPES: dict[str, type["Event"]] = {}  # event type -> its class


# ---- parts of events ------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Victim(JsonShape):
    """One request preempted in a step, and how its KV left the device."""

    _compat: ClassVar[tuple[str, ...]] = ("kind",)

    request_id: str = ""  # the request's id (as in X-Request-Id and the logs)
    move: str = ""  # swap | partial_swap | recompute (schema 1 called it "kind")
    reason: str = ""  # memory | threshold | displaced | quota
    blocks_freed: int = 0  # device blocks given back now
    tokens_to_recompute: int = 0  # recompute: tokens whose KV was dropped
    bytes_moved: int | None = optional()  # swap / partial swap: bytes copied to the host
    bytes_parked: int | None = optional()  # partial swap: bytes kept on the device, parked
    seconds: float | None = optional()  # the copy's own time
    extra: dict = field(default_factory=dict)  # keys this reader does not know, kept as they came

    def to_json(self) -> dict:
        return {**self._fields_json(), "kind": self.move, **self.extra}

    @classmethod
    def from_json(cls, data: dict) -> "Victim":
        v = cls._from_fields(data)
        v.move = v.move or str(data.get("kind", ""))
        return v


@dataclass(kw_only=True)
class SwapMove(JsonShape):
    """One KV copy between the device and the host pool, executed before a step's forward."""

    _compat: ClassVar[tuple[str, ...]] = ("kind",)

    request_id: str = ""  # the request's id (as in X-Request-Id and the logs)
    direction: str = ""  # out (device -> host) | in (host -> device); schema 1: "kind": swap_out | swap_in
    blocks: int = 0  # device blocks the copy covers
    host_layers: int = 0  # layers copied to the host (a partial swap keeps the rest parked)
    bytes_moved: int = 0  # bytes copied between the device and the host
    bytes_parked: int = 0  # bytes kept on the device, parked (a partial swap)
    seconds: float = 0.0  # the copy's own time
    extra: dict = field(default_factory=dict)  # keys this reader does not know, kept as they came

    def to_json(self) -> dict:
        return {"kind": f"swap_{self.direction}", **self._fields_json(), **self.extra}

    @classmethod
    def from_json(cls, data: dict) -> "SwapMove":
        m = cls._from_fields(data)
        m.direction = m.direction or str(data.get("kind", "")).removeprefix("swap_")
        return m


# ---- events ---------------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Event(JsonShape, Mapping):
    """What every event has: its type (the class's) and when it happened.

    An event also reads as a read-only mapping of its JSON form (`event["model"]`), so that a
    reader written over recorded JSON (the hint rules, `gpuserv doctor`) reads a live one alike."""

    type: ClassVar[str] = ""

    t: float = field(default_factory=time.time)  # wall-clock time (time.time())
    extra: dict = field(default_factory=dict)  # keys this reader does not know, kept as they came

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("type"):
            _TYPES[cls.type] = cls

    def to_json(self) -> dict:
        return {"type": self.type, **self._fields_json(), **self.extra}

    @classmethod
    def from_json(cls, data: dict) -> "Event":
        return cls._from_fields(data)

    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self):
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


@dataclass(kw_only=True)
class OtherEvent(Event):
    """An event of a type this reader does not know (a newer daemon's): kept whole."""

    name: str = ""  # its type

    def to_json(self) -> dict:
        return {"type": self.name, "t": self.t, **self.extra}


@dataclass(kw_only=True)
class LayerSuspend(Event):
    """A prefill's forward stopped between layers so that an urgent request could run first."""

    type: ClassVar[str] = "layer_suspend"
    model: str | None = optional()  # set by the engine loop (the engine does not know its name in events)
    step_id: int | None = optional()  # the step, per engine from 1
    layer: int = 0  # the next layer to run when it resumes
    request_ids: list[str] = field(default_factory=list)  # the requests in the suspended forward


@dataclass(kw_only=True)
class LayerResume(Event):
    """A suspended forward ran its remaining layers."""

    type: ClassVar[str] = "layer_resume"
    model: str | None = optional()  # the model it concerns
    step_id: int | None = optional()  # the step, per engine from 1
    layer: int = 0  # the layer it resumed at
    request_ids: list[str] = field(default_factory=list)  # the requests in it


@dataclass(kw_only=True)
class PreemptionModeSwitch(Event):
    """Auto mode switched preemption on or off, with the output-length evidence that decided it."""

    type: ClassVar[str] = "preemption_mode"
    model: str | None = optional()  # the model it concerns
    step_id: int | None = optional()  # the step, per engine from 1
    enabled: bool = False  # preemption is on from now
    p50: float = 0.0  # median output length (tokens) of the recent requests
    p99: float = 0.0  # its 99th percentile (a lower bound while long requests still run)
    ratio: float = 0.0  # p99 / p50
    threshold: float = 0.0  # the ratio above which preemption goes on
    window: int = 0  # finished requests in the estimate
    running: int = 0  # requests still generating, counted as censored lengths
    p99_lower_bound: bool = False  # p99 is only a lower bound


ENGINE_EVENTS = (LayerSuspend, LayerResume, PreemptionModeSwitch)  # made inside the engine, carried in a step record


def _parse_engine_events(values: list) -> list:
    out = []
    for v in values:
        if isinstance(v, dict):  # schema 1 nested them with "kind" where events have "type"
            v = read_event({"type": v.get("type", v.get("kind")), **{k: x for k, x in v.items() if k != "kind"}})
        out.append(v)
    return out


@dataclass(kw_only=True)
class StepRecord(Event):
    """What one engine step did and cost (one per step, in the engine's telemetry ring and on the stream)."""

    type: ClassVar[str] = "step"
    step_id: int = 0  # per engine, from 1
    model: str = ""  # the model it concerns
    wall_s: float = 0.0  # whole step: schedule + forward + sample + update
    forward_s: float = 0.0  # model forward
    sample_s: float = 0.0  # sampling + detokenization + stop checks
    decision_s: float = 0.0  # scheduler decision time (its own cost, kept below what it wins)
    num_prefill_tokens: int = 0  # tokens in prefill chunks
    num_decode_tokens: int = 0  # one-token (decode) chunks
    num_running: int = 0  # after the step's decision
    num_waiting: int = 0  # queued in the scheduler, after the step's decision
    kv_blocks_used: int = 0  # device KV blocks in use after the step
    kv_blocks_total: int = 0  # device KV blocks the model has
    num_preempted: int = 0  # requests preempted this step
    num_finished: int = 0  # requests that finished this step
    preempted_ids: list[str] = field(default_factory=list)  # which requests were preempted this step
    swap_s: float = 0.0  # KV copies (swap out / in, parking) before the forward
    # per victim, in Victim's JSON form (the engine's tests and /metrics read these keys directly)
    preemptions: list[dict] = field(default_factory=list, metadata={"parse": upgrade(Victim)})
    swaps: list[dict] = field(default_factory=list, metadata={"parse": upgrade(SwapMove)})  # per copy, SwapMove's JSON
    events: list[Event] = field(default_factory=list, metadata={"parse": _parse_engine_events})  # ENGINE_EVENTS
    preemption_on: bool = False  # displacement and the planner active at this step
    kv_host_blocks_used: int = 0  # the host swap pool
    kv_host_blocks_total: int = 0  # blocks in the host swap pool
    kv_blocks_reserved: int = 0  # free blocks promised to requests that may not be preempted again
    num_prefix_query_tokens: int = 0  # prefix cache: known tokens of the requests admitted fresh this step
    num_prefix_hit_tokens: int = 0  # of them, reused from cached blocks (not computed)
    num_prefix_repeat_tokens: int = 0  # caching off: of them, tokens a prefix cache would have reused
    prefix_caching: bool = False  # engine.prefix_caching at this step

    def to_dict(self) -> dict:
        """The record without its type (the form `gpuserv bench` and doctor keep)."""
        out = self.to_json()
        del out["type"]
        return out


@dataclass(kw_only=True)
class Preemption(Event):
    """A step preempted requests (also in its step record; one line per fact reads better)."""

    type: ClassVar[str] = "preemption"
    model: str = ""  # the model it concerns
    step_id: int = 0  # the step, per engine from 1
    num_preempted: int = 0  # requests preempted in the step
    request_ids: list[str] = field(default_factory=list)  # the requests in it
    # each preempted request, with its move and cost
    victims: list[Victim] = field(default_factory=list, metadata={"parse": parse_list(Victim)})


@dataclass(kw_only=True)
class Swap(Event):
    """A KV copy to or from the host pool (one per copy; its step record has them too)."""

    type: ClassVar[str] = "swap"
    _compat: ClassVar[tuple[str, ...]] = ("kind",)
    model: str = ""  # the model it concerns
    step_id: int = 0  # the step, per engine from 1
    request_id: str = ""  # the request's id (as in X-Request-Id and the logs)
    direction: str = ""  # out | in (schema 1: "kind": swap_out | swap_in, still written)
    blocks: int = 0  # device blocks the copy covers
    host_layers: int = 0  # layers copied to the host (a partial swap keeps the rest parked)
    bytes_moved: int = 0  # bytes copied between the device and the host
    bytes_parked: int = 0  # bytes kept on the device, parked (a partial swap)
    seconds: float = 0.0  # the copy's own time

    def to_json(self) -> dict:
        return {**super().to_json(), "kind": f"swap_{self.direction}"}

    @classmethod
    def from_json(cls, data: dict) -> "Swap":
        s = cls._from_fields(data)
        s.direction = s.direction or str(data.get("kind", "")).removeprefix("swap_")
        return s


@dataclass(kw_only=True)
class EngineError(Event):
    """An engine step raised: its requests failed (the traceback is logged under error_id)."""

    type: ClassVar[str] = "engine_error"
    model: str = ""  # the model it concerns
    error_id: str = ""  # the id its traceback is logged under
    error: str = ""  # exception type and message
    num_failed_requests: int = 0  # requests that failed with it


@dataclass(kw_only=True)
class ModelLoad(Event):
    """A model load's progress: phase start, layer (a layered load, per layer), ready or failed."""

    type: ClassVar[str] = "model_load"
    model: str = ""  # the model it concerns
    phase: str = ""  # start | layer | ready | failed
    device: str | None = optional()  # where it loads (layer, ready, failed)
    layer: int | None = optional()  # layer: the layer that landed
    layers_loaded: int | None = optional()  # layer: how many are on the device
    num_layers: int | None = optional()  # layer, ready
    layer_s: float | None = optional()  # layer: seconds that layer took
    load_s: float | None = optional()  # ready: seconds from start to serving
    tier: str | None = optional()  # ready: where the weights came from (device | host | disk | disk-int8 | delta...)
    isolation: str | None = optional()  # ready: thread | process
    worker_pid: int | None = optional()  # ready, in an engine worker process
    base: str | None = optional()  # ready, a variant: its base model
    delta_bytes_read: int | None = optional()  # ready, a variant: bytes read for its delta
    error: str | None = optional()  # failed: why


@dataclass(kw_only=True)
class ModelUnload(Event):
    """A model was unloaded (asked, or evicted); its unfinished requests were aborted."""

    type: ClassVar[str] = "model_unload"
    model: str = ""  # the model it concerns
    device: str | None = None  # the device (cpu, cpu:N, cuda:N)
    num_aborted: int = 0  # its unfinished requests, aborted
    reason: str = ""  # asked | evicted | keep_alive (idle past its keep_alive) ("" from older daemons)


@dataclass(kw_only=True)
class ModelEvict(Event):
    """A model leaves the device to make room for another (its unload follows)."""

    type: ClassVar[str] = "model_evict"
    model: str = ""  # the model it concerns
    for_model: str = field(default="", metadata={"json": "for"})  # the model being loaded
    device: str = ""  # the device (cpu, cpu:N, cuda:N)
    to_tier: str = ""  # host | disk: where its weights stay readable


@dataclass(kw_only=True)
class ModelPin(Event):
    """A model was pinned or unpinned (pinned models are never evicted)."""

    type: ClassVar[str] = "model_pin"
    model: str = ""  # the model it concerns
    pinned: bool = False  # pinned now (a pinned model is never evicted)


@dataclass(kw_only=True)
class Prefetch(Event):
    """A model's load was started ahead of demand: it usually follows the one just asked for."""

    type: ClassVar[str] = "prefetch"
    model: str = ""  # the model it concerns
    after: str = ""  # the model just asked for
    probability: float = 0.0  # that `model` follows `after`


@dataclass(kw_only=True)
class CacheHitRateLow(Event):
    """The device hit rate of the weight cache fell under its alert, with a sizing suggestion."""

    type: ClassVar[str] = "cache_hit_rate_low"
    hit_rate: float = 0.0  # device hits over the window's lookups
    window: int = 0  # lookups it covers
    models_for_90pct: int = 0  # models that carry 90% of them
    cache_size: int = 0  # cache.cache_size now
    suggested_cache_size: int = 0  # a cache_size that would hold the models carrying 90% of the requests
    message: str = ""  # the suggestion, in words (also logged)


@dataclass(kw_only=True)
class EngineWorkerExit(Event):
    """A model's engine worker process exited unasked: the model is failed, its requests got 503s."""

    type: ClassVar[str] = "engine_worker_exit"
    model: str = ""  # the model it concerns
    state: str = "failed"  # the model's state now
    device: str | None = None  # the device (cpu, cpu:N, cuda:N)
    pid: int = 0  # the worker process's pid
    exit_code: int | None = None  # its exit code (None: killed by a signal)
    signal: int | None = None  # the signal that killed it (None: it exited)
    reason: str = ""  # e.g. "killed by signal 9 (SIGKILL)"
    num_failed_requests: int = 0  # requests that failed with it


@dataclass(kw_only=True)
class RequestFinished(Event):
    """A request ended (any way: finished, aborted, refused after admission)."""

    type: ClassVar[str] = "request_finished"
    model: str = ""  # the model it concerns
    request_id: str = ""  # the request's id (as in X-Request-Id and the logs)
    tenant: str = ""  # the tenant it was admitted under
    uid: int | None = None  # the client's uid (None over TCP)
    status: int = 200  # the outcome in HTTP's numbering
    finish_reason: str | None = None  # stop | length | abort
    num_prompt_tokens: int = 0  # prompt tokens
    num_output_tokens: int = 0  # tokens generated
    ttft_s: float | None = None  # time to the first token (None: none came)
    e2e_s: float = 0.0  # arrival to end
    priority: int = 0  # its effective priority (the tenant's unless the request set one)
    arrival_t: float | None = optional()  # wall-clock arrival (older daemons: t - e2e_s)


@dataclass(kw_only=True)
class RequestPrompt(Event):
    """A request's prompt text; sent only to readers that name this type (`gpuserv record --with-prompts`)."""

    type: ClassVar[str] = "request_prompt"
    model: str = ""  # the model it concerns
    request_id: str = ""  # the request's id (as in X-Request-Id and the logs)
    prompt: str = ""  # the prompt as text (chat: the rendered template)


@dataclass(kw_only=True)
class Drain(Event):
    """A drain started (admission stops) or finished."""

    type: ClassVar[str] = "drain"
    phase: str = ""  # start | done
    num_in_flight: int | None = optional()  # start
    timeout_s: float | None = optional()  # start
    num_finished: int | None = optional()  # done
    num_aborted: int | None = optional()  # done


@dataclass(kw_only=True)
class Reload(Event):
    """The config was reloaded (SIGHUP or POST /admin/reload)."""

    type: ClassVar[str] = "reload"
    reloaded: bool = True  # the new config took effect (a failed reload publishes nothing)
    changed: dict = field(default_factory=dict)  # server field -> its new value
    engine_changed: bool = False  # engine settings changed (they apply at the next load)
    needs_restart: list[str] = field(default_factory=list)  # settings that apply only after a restart
    tenants: list[str] = field(default_factory=list)  # the tenant names now


@dataclass(kw_only=True)
class Versions(Event):
    """An alias's version weights were changed at run time."""

    type: ClassVar[str] = "versions"
    model: str = ""  # the alias
    versions: dict = field(default_factory=dict)  # version -> weight ({} removes the alias)


@dataclass(kw_only=True)
class Hint(Event):
    """A troubleshooting hint turned on (or off), with the evidence that fired it."""

    type: ClassVar[str] = "hint"
    name: str = ""  # the rule
    model: str | None = None  # None: the whole daemon
    active: bool = True  # on (True) or cleared (False)
    symptom: str = ""  # what an operator sees, in words
    cause: str = ""  # the likely cause, in words
    since: float = 0.0  # when it turned on
    evidence: dict = field(default_factory=dict)  # the numbers that fired the rule
    action: str = ""  # what to do, with the evidence's numbers


@dataclass(kw_only=True)
class TimeSlice(Event):
    """The arbiter handed a device group from one model to the next."""

    type: ClassVar[str] = "time_slice"
    device: str = ""  # the device (cpu, cpu:N, cuda:N)
    quantum_ms: float = 0.0  # the arbiter's time slice
    model: str = ""  # the model that gave the device up
    group: str = ""  # the device group (partition) the models share
    run_s: float = 0.0  # how long it held it
    switch_s: float = 0.0  # the handoff's overhead
    reason: str = ""  # quantum | idle | preempted | throttled | unload
    next: str = ""  # the model that holds it now


@dataclass(kw_only=True)
class BandwidthThrottle(Event):
    """A best-effort model's duty cycle changed (bandwidth priority), with the pressure that moved it."""

    type: ClassVar[str] = "bandwidth_throttle"
    model: str = ""  # the model it concerns
    duty: float = 1.0  # the share of time it may issue steps now
    previous: float = 1.0  # the duty before this change
    device: str = ""  # the device (cpu, cpu:N, cuda:N)
    reason: str = ""  # over target | memory bandwidth | calibrating | calm
    latency_critical: str | None = optional()  # the model whose latency caused it
    step_ms_p90: float | None = optional()  # the latency-critical model's P90 step time (over target)
    target_ms: float | None = optional()  # its target step time (None while calibrating)
    mem_bw_util_pct: float | None = optional()  # the device's memory-bandwidth use (memory bandwidth pressure)
    threshold_pct: float | None = optional()  # the bandwidth use above which best-effort models are throttled


@dataclass(kw_only=True)
class Dropped(Event):
    """This reader fell behind: the daemon dropped events for it rather than slow the engine."""

    type: ClassVar[str] = "dropped"
    num_events: int = 0  # events dropped since the last notice


@dataclass(kw_only=True)
class Hello(Event):
    """The first line of /admin/events: what the daemon holds, and the schema of what follows."""

    type: ClassVar[str] = "hello"
    models: list[str] = field(default_factory=list)  # the models it hosts (any state)
    state: str = ""  # starting | serving | draining
    schema: int = 1  # 1 when a daemon does not say (before this module)


PRIVATE_TYPES = (RequestPrompt.type,)  # sent only to readers that ask for the type by name


def read_event(data: dict) -> Event:
    """An event from its JSON (schema 1 or 2); an unknown type is an OtherEvent that keeps everything."""
    cls = _TYPES.get(data.get("type"))
    if cls is None:
        return OtherEvent(name=str(data.get("type")), t=data.get("t", 0.0),
                          extra={k: v for k, v in data.items() if k not in ("type", "t")})
    return cls.from_json(data)

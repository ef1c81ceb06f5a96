"""Typed events: one `type` each, a stable JSON shape, and a reader for both schemas (1: the console's
replay fixtures, before the types; 2: now)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from gpuservd.engine.step_events import detail_events
from gpuservd.events import EventBus
from gpuservd.events import types as ev

FIXTURE = Path(__file__).parent / "console_fixtures" / "stream.ndjson"

# Schema-1 lines as the daemon wrote them before the event types.
OLD_SWAP = {"type": "swap", "t": 5.0, "model": "m", "step_id": 9, "kind": "swap_out", "request_id": "r1",
            "blocks": 4, "host_layers": 2, "bytes_moved": 4096, "bytes_parked": 1024, "seconds": 0.002}
OLD_VICTIM = {"kind": "partial_swap", "request_id": "r1", "reason": "memory", "blocks_freed": 3,
              "tokens_to_recompute": 0, "bytes_moved": 4096, "bytes_parked": 1024, "seconds": 0.002}
OLD_STEP_EVENTS = [{"kind": "layer_suspend", "layer": 2, "request_ids": ["a"]},
                   {"kind": "preemption_mode", "enabled": True, "p50": 2, "p99": 40, "ratio": 20.0, "threshold": 5.0,
                    "window": 8, "running": 0, "p99_lower_bound": False}]


def _sample(cls):
    """An instance of an event class with a non-default value in every field it can hold one."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name == "extra":
            continue
        hint = str(f.type)
        if "list" in hint:
            values[f.name] = []
        elif "dict" in hint:
            values[f.name] = {"k": 1}
        elif "bool" in hint:
            values[f.name] = True
        elif "float" in hint:
            values[f.name] = 1.5
        elif "int" in hint:
            values[f.name] = 7
        else:
            values[f.name] = f"{f.name}-value"
    return cls(**values)


@pytest.mark.parametrize("cls", sorted(ev._TYPES.values(), key=lambda c: c.type), ids=lambda c: c.type)
def test_every_event_type_round_trips_through_its_json(cls):
    event = _sample(cls)
    data = json.loads(json.dumps(event.to_json()))  # what /admin/events sends
    assert data["type"] == cls.type and list(data)[:2] == ["type", "t"]
    back = ev.read_event(data)
    assert type(back) is cls and back == event
    assert dict(event) == data  # the mapping view is the JSON form


def test_every_field_has_a_default():
    """So that an event missing keys (an older daemon's) still reads."""
    for cls in list(ev._TYPES.values()) + [ev.Victim, ev.SwapMove]:
        for f in dataclasses.fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, (cls, f.name)


def test_every_field_is_commented_in_its_class():
    """A reader of types.py learns each field's meaning where it is declared."""
    src = Path(ev.__file__).read_text().splitlines()
    for cls in list(ev._TYPES.values()) + [ev.Victim, ev.SwapMove]:
        for f in dataclasses.fields(cls):
            if f.name in ("t", "extra"):
                continue
            at = [i for i, line in enumerate(src) if line.strip().startswith(f"{f.name}:")]
            assert at and all("#" in src[i] or src[i - 1].strip().startswith("#") for i in at), (cls.__name__, f.name)


def test_schema_1_fixture_reads_and_writes_back_the_same_json():
    lines = [json.loads(x) for x in FIXTURE.read_text().splitlines()]
    events = [x["data"] for x in lines if x["source"] == "event"]
    kinds = {e["type"] for e in events}
    assert {"step", "preemption", "request_finished", "model_load", "hello"} <= kinds
    for data in events:
        event = ev.read_event(data)
        assert not isinstance(event, ev.OtherEvent), data["type"]
        out = event.to_json()
        for key, value in data.items():  # nothing the old daemon sent is lost or changed
            if key == "victims":
                assert [{k: v[k] for k in old} for v, old in zip(out[key], value)] == value
            elif key == "preemptions":
                assert [{k: v[k] for k in old} for v, old in zip(out[key], value)] == value
            else:
                assert out[key] == value, key
    hello = ev.read_event(next(e for e in events if e["type"] == "hello"))
    assert isinstance(hello, ev.Hello) and hello.schema == 1  # a daemon from before the schema number
    pre = next(ev.read_event(e) for e in events if e["type"] == "preemption" and e.get("victims"))
    assert pre.victims and all(v.move in ("swap", "partial_swap", "recompute") for v in pre.victims)


def test_schema_1_swap_and_victim_read_their_kind_as_move_and_direction():
    swap = ev.read_event(OLD_SWAP)
    assert isinstance(swap, ev.Swap) and swap.direction == "out" and swap.bytes_parked == 1024
    assert swap.to_json()["kind"] == "swap_out"  # still written, for schema-1 readers
    victim = ev.Victim.from_json(OLD_VICTIM)
    assert victim.move == "partial_swap" and victim.to_json()["kind"] == "partial_swap"
    assert ev.Victim.from_json(victim.to_json()) == victim


def test_schema_1_step_record_reads_its_nested_engine_events():
    old = {"type": "step", "t": 3.0, "step_id": 4, "model": "m", "wall_s": 0.01, "events": OLD_STEP_EVENTS,
           "preemptions": [OLD_VICTIM], "swaps": [{k: v for k, v in OLD_SWAP.items()
                                                    if k not in ("type", "t", "model", "step_id")}]}
    rec = ev.read_event(old)
    assert isinstance(rec, ev.StepRecord)
    assert [type(e) for e in rec.events] == [ev.LayerSuspend, ev.PreemptionModeSwitch]
    assert rec.events[1].enabled and rec.events[1].ratio == 20.0
    assert rec.preemptions[0]["move"] == "partial_swap" and rec.swaps[0]["direction"] == "out"
    # the engine loop splits a step into one event per fact, stamped with the step's model and id
    details = detail_events(dataclasses.replace(rec, num_preempted=1, preempted_ids=["r1"]))
    assert [e.type for e in details] == ["preemption", "swap", "layer_suspend", "preemption_mode"]
    assert all(e.model == "m" and e.step_id == 4 and e.t == 3.0 for e in details)


def test_unknown_types_and_fields_pass_through_unchanged():
    future = {"type": "kv_prefix_hit", "t": 1.0, "model": "m", "num_blocks": 3}
    event = ev.read_event(future)
    assert isinstance(event, ev.OtherEvent) and event.to_json() == future
    newer = {"type": "model_pin", "t": 2.0, "model": "m", "pinned": True, "by": "admin"}
    pin = ev.read_event(newer)
    assert isinstance(pin, ev.ModelPin) and pin.extra == {"by": "admin"} and pin.to_json() == newer


def test_optional_fields_stay_out_of_the_json_until_set():
    assert ev.ModelLoad(model="m", phase="start", t=1.0).to_json() == {"type": "model_load", "t": 1.0,
                                                                       "model": "m", "phase": "start"}
    ready = ev.ModelLoad(model="m", phase="ready", t=1.0, device="cpu", load_s=0.5, worker_pid=None)
    assert "worker_pid" not in ready.to_json() and ready.to_json()["load_s"] == 0.5
    assert ev.ModelEvict(model="a", for_model="b", t=1.0).to_json()["for"] == "b"  # a keyword in Python


def test_the_bus_carries_typed_events_and_reads_json_shaped_ones():
    import asyncio

    async def main():
        bus = EventBus()
        sub = bus.subscribe({"swap", "dropped"})
        bus.publish(OLD_SWAP)  # a JSON-shaped dict (a replayed recording) is read into its type
        bus.publish(ev.ModelPin(model="m", pinned=True))
        bus.close()
        return [e async for e in sub], list(bus.recent_events)

    got, recent = asyncio.run(main())
    assert [type(e) for e in got] == [ev.Swap] and got[0].direction == "out"
    assert [type(e) for e in recent] == [ev.Swap, ev.ModelPin]

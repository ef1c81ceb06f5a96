"""A step's facts as events of their own: what the engine loop publishes beside each step record."""

from __future__ import annotations

from dataclasses import replace

from gpuservd.events.types import Event, Preemption, StepRecord, Swap, SwapMove, Victim


def detail_events(rec: StepRecord) -> list[Event]:
    """A step's preemptions, KV swaps and the engine's own events as events of their own (for the console,
    `gpuserv events` and the logs): the step record has them too, but one line per fact reads better."""
    base = {"t": rec.t, "model": rec.model, "step_id": rec.step_id}
    out: list[Event] = []
    if rec.num_preempted:
        out.append(Preemption(**base, num_preempted=rec.num_preempted, request_ids=list(rec.preempted_ids),
                              victims=[Victim.from_json(v) for v in rec.preemptions]))
    for m in rec.swaps:
        move = SwapMove.from_json(m)
        out.append(Swap(**base, request_id=move.request_id, direction=move.direction, blocks=move.blocks,
                        host_layers=move.host_layers, bytes_moved=move.bytes_moved, bytes_parked=move.bytes_parked,
                        seconds=move.seconds))
    out.extend(replace(e, **base) for e in rec.events)
    return out

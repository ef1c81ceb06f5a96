"""Overlap: the host schedules and launches decode step N+1 while step N runs on the device.

On a GPU a graph-replayed decode step takes about as long as the host's work around it (scheduling,
building the inputs, handing out tokens, detokenizing), and done in turn the two add up. With overlap
(vLLM's async scheduling, SGLang's overlap scheduler) a step that is decode-only and chosen entirely on
the device is launched and not read: its requests are advanced and given a placeholder output token
(PENDING). The next step() schedules against those placeholders, launches step N+1, whose rows take
their input token straight from step N's choice on the device (DecodeStep.resolve_ids: no host round
trip), and only then reads step N's ids (one small copy, long finished or finishing behind N+1 in the
stream) and hands them out. So the device always has the next step queued while the host works.

What it costs, as in vLLM: a request that stops at step N was already in step N+1; that row's result
is dropped (its KV write lands in its own, now freed, blocks, ordered before any later step that
reuses them on the same stream). The last step of a run is one launched for nothing.

A step chains only when the fixed-shape step takes it and nothing needs the host between the two:
no prefill, no KV moves (swaps), no suspended forward, every row chosen on the device (plain greedy
or plain sampling). Any other step first reads the step in flight, drops the rows that finished in
it, and runs as without overlap. On the CPU the forward is not asynchronous, so overlap only
reorders the host work there; it is off unless engine.overlap is true (the tests turn it on).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from gpuservd.engine import step_rows
from gpuservd.engine.request import Request, RequestOutput
from gpuservd.engine.schedule_output import SchedulerOutput
from gpuservd.runner.decode_step import DecodeResult

PENDING = -1  # an output token the device chose and the host has not read yet


@dataclass
class InFlight:
    """A decode step launched and not read yet."""

    result: DecodeResult  # its ids and stop verdicts, on their way to the host
    requests: list[Request]  # row i's request


def chainable(engine, sched: SchedulerOutput) -> bool:
    """Whether this schedule can launch before the step in flight is read."""
    step = engine.runner.decode_step
    return (step is not None and not sched.empty and not sched.moves and sched.num_prefill_tokens == 0
            and engine._suspended is None and len(sched.chunks) <= step.batch_sizes[-1]
            and all(c.num_tokens == 1 and c.sample and not c.request.wants_prompt_logits
                    and step_rows.device_chosen(c.request.params) for c in sched.chunks))


def launch(engine, sched: SchedulerOutput, flight: InFlight | None, t0: float) -> list[RequestOutput]:
    """Launch a chainable schedule, then read and hand out the step in flight (if any); the launched step
    becomes the one in flight. Returns the outputs of the step read."""
    rows = {id(r): i for i, r in enumerate(flight.requests)} if flight is not None else {}
    sources = [rows.get(id(c.request), -1) if c.request.output_token_ids[-1:] == [PENDING] else -1
               for c in sched.chunks]
    chunks = step_rows.seq_chunks(sched.chunks, engine.scheduler.kv, engine.eos_token_ids, on_device=True)
    t1 = time.perf_counter()
    result = engine.runner.execute(chunks, suspend=engine._layer_hook(sched), sources=sources)
    forward_s = time.perf_counter() - t1
    outputs = land(engine, flight) if flight is not None else []
    live = [c.request for c in sched.chunks]
    for r in live:
        if engine.requests.get(r.request_id) is r:  # not finished by the step just read
            r.advance(1)
            r.output_token_ids.append(PENDING)
    engine._inflight = InFlight(result, live)
    engine._record(sched, t0, forward_s, 0.0, outputs)
    return outputs


def land(engine, flight: InFlight) -> list[RequestOutput]:
    """Read the step in flight (waits for its one small copy) and hand out its tokens; rows whose request
    finished or was aborted meanwhile are dropped."""
    ids, stops = flight.result.host()
    keep = [i for i, r in enumerate(flight.requests)
            if engine.requests.get(r.request_id) is r and r.output_token_ids[-1:] == [PENDING]]
    reqs = [flight.requests[i] for i in keep]
    for r in reqs:
        r.output_token_ids.pop()
    return engine._hand_out(reqs, [ids[i] for i in keep], [None] * len(keep), [stops[i] for i in keep])


def drop_finished(engine, sched: SchedulerOutput) -> None:
    """After a read: the schedule's chunks of requests that finished in it are not run."""
    kept = [c for c in sched.chunks if engine.requests.get(c.request.request_id) is c.request]
    if len(kept) != len(sched.chunks):
        sched.chunks = kept
        sched.num_decode_tokens = sum(c.num_tokens for c in kept if c.num_tokens == 1)
        sched.num_prefill_tokens = sum(c.num_tokens for c in kept if c.num_tokens > 1)


def unpend(req: Request) -> None:
    """An aborted request's placeholder goes (its output is what the host has read)."""
    if req.output_token_ids[-1:] == [PENDING]:
        req.output_token_ids.pop()

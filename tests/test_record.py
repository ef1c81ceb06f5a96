"""`gpuserv record` pieces without a daemon: event -> trace line, prompts only when asked, the time limit with
an idle stream, and a bare .jsonl trace as a bench workload. (The live recording and its replay are in
test_hints_daemon.py; the event bus's private prompt events are checked here.)"""

from __future__ import annotations

import asyncio
import io
import json
import threading
import time

from gpuservd.bench.record import TraceRecorder, record, trace_line
from gpuservd.bench.workload import load_workload
from gpuservd.events import EventBus

T0 = 1000.0


def done(rid="r1", arrival=1002.5, status=200, out=7, **kw):
    return {"type": "request_finished", "t": arrival + 1.0, "model": "tiny", "request_id": rid, "tenant": "batch",
            "status": status, "num_prompt_tokens": 12, "num_output_tokens": out, "e2e_s": 1.0, "priority": 2,
            "arrival_t": arrival, **kw}


def test_trace_line_keeps_lengths_tenant_priority_and_arrival():
    assert trace_line(done(), T0) == {"t": 2.5, "model": "tiny", "prompt_tokens": 12, "output_tokens": 7,
                                      "priority": 2, "tenant": "batch"}
    assert trace_line(done(), T0, "hi there") == {"t": 2.5, "model": "tiny", "prompt": "hi there", "output_tokens": 7,
                                                  "priority": 2, "tenant": "batch"}
    old = done(arrival_t=None)  # a daemon without arrival_t: finish time minus latency
    assert trace_line(old, T0)["t"] == 2.5


def test_trace_line_skips_what_would_not_replay():
    assert trace_line(done(status=400), T0) is None
    assert trace_line(done(out=0), T0) is None
    assert trace_line(done(arrival=999.0), T0) is None  # arrived before the recording


def test_recorder_joins_prompts_only_when_asked():
    out = io.StringIO()
    rec = TraceRecorder(out, T0, with_prompts=True)
    rec.feed({"type": "request_prompt", "request_id": "r1", "prompt": "secret text"})
    rec.feed(done("r1"))
    rec.feed(done("r2", status=500))
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert lines == [{"t": 2.5, "model": "tiny", "prompt": "secret text", "output_tokens": 7, "priority": 2,
                      "tenant": "batch"}]
    assert (rec.num_written, rec.num_skipped, rec.models, rec.prompts) == (1, 1, {"tiny": 1}, {})


class IdleClient:
    """A daemon that says hello, sends one request, then stays quiet until closed."""

    def __init__(self):
        self.closed = threading.Event()
        self.types = None

    def events(self, types):
        self.types = types
        yield {"type": "hello"}
        yield done(arrival=time.time() + 0.01)
        self.closed.wait(10)
        raise RuntimeError("stream closed")

    def close(self):
        self.closed.set()


def test_record_stops_at_its_time_limit_on_an_idle_stream(tmp_path):
    client = IdleClient()
    t = time.monotonic()
    rec = record(client, tmp_path / "sub" / "trace.jsonl", 0.3, log=lambda m: None)
    assert time.monotonic() - t < 5 and client.closed.is_set()  # did not wait for traffic that never came
    assert client.types == ["request_finished"]  # no prompt events unless asked
    assert rec.num_written == 1 and len((tmp_path / "sub" / "trace.jsonl").read_text().splitlines()) == 1


def test_bare_trace_is_a_workload(tmp_path):
    trace = tmp_path / "live.jsonl"
    trace.write_text(json.dumps({"t": 0.5, "model": "tiny", "prompt_tokens": 9, "output_tokens": 3, "priority": 1,
                                 "tenant": "a"}) + "\n" +
                     json.dumps({"t": 0.1, "model": "tiny", "prompt": "hello", "output_tokens": 5}) + "\n")
    wl = load_workload(trace)
    assert (wl.name, wl.model, wl.class_names()) == ("live", "tiny", ["default"])
    reqs = wl.materialize(1000, [2], tokenize=lambda s: [101] * len(s))
    assert [(r.arrival_s, len(r.prompt_token_ids), r.output_tokens, r.priority, r.tenant) for r in reqs] == [
        (0.1, 5, 5, 0, "default"), (0.5, 9, 3, 1, "a")]


def test_prompt_events_go_only_to_readers_that_ask():
    async def main():
        bus = EventBus()
        everything, finished, prompts = bus.subscribe(), bus.subscribe({"request_finished"}), \
            bus.subscribe({"request_finished", "request_prompt"})
        assert bus.wants("request_prompt")
        tapped = []
        bus.taps.append(tapped.append)
        bus.publish({"type": "request_prompt", "prompt": "secret"})
        bus.publish(done())
        bus.close()
        got = [[e["type"] async for e in sub] for sub in (everything, finished, prompts)]
        return got, tapped, list(bus.recent_events)

    got, tapped, recent = asyncio.run(main())
    assert got == [["request_finished"], ["request_finished"], ["request_prompt", "request_finished"]]
    assert [e["type"] for e in tapped] == ["request_prompt", "request_finished"]
    assert [e["type"] for e in recent] == ["request_finished"]  # never replayed to a late reader

"""The streaming path from the engine thread to the SSE bytes: one hand-off per engine step however many
streams run, one wake-up per stream per hand-off, outputs that arrive together rendered as one correct
chunk, and the CPU readings the socket benchmark divides by the tokens it streamed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from types import SimpleNamespace

from gpuservd.api import responses
from gpuservd.api.choices import Choice
from gpuservd.api.protocol import GenerationRequest
from gpuservd.bench.daemon_cpu import cpu_per_token
from gpuservd.engine.loop import Accepted, EngineLoop, Submission
from gpuservd.engine.request import FinishReason, RequestOutput, SamplingParams
from gpuservd.engine.sampler import TokenLogprobs
from gpuservd.serving.request_stream import RequestSink

from test_engine import make_engine


class _RecordingLoop:
    """Stands in for the asyncio loop the engine thread posts to: records each hand-off and runs it."""

    def __init__(self):
        self.handoffs: list[list] = []
        self.lock = threading.Lock()

    def call_soon_threadsafe(self, fn, deliveries, events):
        with self.lock:
            self.handoffs.append(list(deliveries))
        fn(deliveries, events)


def test_one_handoff_per_engine_step_for_many_streams(tiny_model_dir):
    num_streams, num_tokens = 16, 6
    aloop = _RecordingLoop()
    got: dict[str, list] = {}
    done = threading.Event()

    class Sink:
        def __init__(self, rid):
            self.rid = rid

        def put(self, item):
            got.setdefault(self.rid, []).append(item)
            if len([o for v in got.values() for o in v if isinstance(o, RequestOutput) and o.finished]) == num_streams:
                done.set()

    loop = EngineLoop("tiny", lambda: make_engine(tiny_model_dir), aloop, lambda d, e: [s.put(i) for s, i in d])
    # Queued before the thread starts: the first iteration admits them all at once.
    for i in range(num_streams):
        loop.submit(Submission(f"r{i}", [3 + i, 4, 5, 6], SamplingParams(max_tokens=num_tokens, ignore_eos=True),
                               Sink(f"r{i}")))
    loop.start()
    try:
        assert done.wait(120)
    finally:
        loop.stop()
    steps = loop.engine.telemetry.num_steps
    handoffs = [h for h in aloop.handoffs if h]
    assert len(handoffs) == steps  # one call_soon_threadsafe per step, not one per stream or per token
    for h in handoffs:
        rids = [item.request_id for _, item in h if isinstance(item, RequestOutput)]
        assert len(rids) == len(set(rids))  # at most one output per stream per hand-off (and its Accepted)
    outputs = [i for v in got.values() for i in v if isinstance(i, RequestOutput)]
    assert sum(len(o.new_token_ids) for o in outputs) == num_streams * num_tokens
    # a step carries every stream's token together
    assert max(sum(isinstance(i, RequestOutput) for _, i in h) for h in handoffs) == num_streams
    assert all(isinstance(v[0], Accepted) for v in got.values())


def test_a_sink_wakes_its_reader_once_for_everything_that_arrived():
    async def main():
        sink = RequestSink()
        taken = []

        async def reader():
            taken.append(await sink.take())
            taken.append(await sink.take())

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # the reader waits
        for i in range(3):  # what one engine hand-off delivers (or three a lagging reader missed)
            sink.put(i)
        await asyncio.sleep(0)
        assert taken == [[0, 1, 2]] and sink.num_wakeups == 1
        sink.put(3)
        await task
        assert taken == [[0, 1, 2], [3]] and sink.num_wakeups == 2
        sink.put("a")
        sink.put("b")
        first = await sink.get()
        sink.unget(first)  # looked at, handed back in front
        assert await sink.take() == ["a", "b"]

    asyncio.run(main())


def _out(rid, tok, text, n, finished=False, lp=None):
    return RequestOutput(rid, [tok], text, finished, FinishReason.LENGTH if finished else None, 4, n, 0.0, 0.0,
                         0.0 if finished else None, logprobs=[lp] if lp else None)


def test_outputs_that_arrived_together_make_one_correct_chunk():
    tokenizer = SimpleNamespace(decode=lambda ids, **kw: "".join(f"<{i}>" for i in ids))
    active = SimpleNamespace(ctx=SimpleNamespace(request_id="cmpl-1"), slot=SimpleNamespace(tokenizer=tokenizer))
    for kind in ("completion", "chat"):
        greq = GenerationRequest(kind=kind, model="m", prompt="p" if kind == "completion" else None,
                                 return_token_ids=True, logprobs=1)
        lps = [TokenLogprobs(7 + i, -0.5 * (i + 1), [(7 + i, -0.5 * (i + 1))]) for i in range(3)]
        outs = [_out("cmpl-1", 7 + i, f"t{i}é", i + 1, finished=(i == 2), lp=lps[i]) for i in range(3)]
        coalesced = Choice(0, active, greq, 5, True)
        one = json.loads(coalesced.chunk(outs)[len(b"data: "):])
        apart = Choice(0, active, greq, 5, True)
        chunks = [json.loads(apart.chunk([o])[len(b"data: "):]) for o in outs]
        c = one["choices"][0]
        text = c["delta"]["content"] if kind == "chat" else c["text"]
        assert text == "t0ét1ét2é" == "".join(
            x["choices"][0]["delta"]["content"] if kind == "chat" else x["choices"][0]["text"] for x in chunks)
        assert c["token_ids"] == [7, 8, 9] and c["finish_reason"] == "length"
        if kind == "chat":
            assert [e["token"] for e in c["logprobs"]["content"]] == ["<7>", "<8>", "<9>"]
            assert [e["logprob"] for e in c["logprobs"]["content"]] == [-0.5, -1.0, -1.5]
        else:  # offsets continue across the tokens of the one chunk as they do across separate chunks
            assert c["logprobs"]["text_offset"] == [y for x in chunks for y in x["choices"][0]["logprobs"]["text_offset"]]
            assert c["logprobs"]["token_logprobs"] == [-0.5, -1.0, -1.5]


def test_sse_json_falls_back_for_what_orjson_refuses():
    lone = "echo \ud83d"  # a lone surrogate: a JSON client may send one escaped, and echo returns it
    assert json.loads(responses.sse({"t": lone})[6:]) == {"t": lone}
    enc = responses.ChunkEncoder("completion", "r", "m", 1, True, False)
    assert json.loads(enc.encode(lone, None, [1])[6:])["choices"][0]["text"] == lone


def test_sse_lines_survive_a_reader_that_splits_on_unicode_line_ends():
    """A token may decode to U+0085, U+2028 or U+2029 (a random model's do): str.splitlines, and httpx's
    iter_lines with it, ends a line there. Escaped, each event stays one line and reads back the same."""
    import httpx

    odd = "a\x85b\u2028c\u2029d’é"  # and ordinary non-ASCII (U+2019 shares U+2028's first two bytes) stays raw
    enc = responses.ChunkEncoder("completion", "r", "m", 1, True, False)
    events = [responses.sse({"t": odd}), enc.encode(odd, None, [1]), enc.encode(odd, "length", [2])]
    for raw in events:
        assert "’é".encode() in raw
        lines = httpx.Response(200, content=raw).iter_lines()
        data = [line for line in lines if line]
        assert len(data) == 1 and data[0].startswith("data: ")
        got = json.loads(data[0][6:])
        assert odd in (got.get("t"), got.get("choices", [{}])[0].get("text"))
    assert responses.dumps(odd) == json.dumps(odd).encode().replace(b"\\u2019", "’".encode()).replace(
        b"\\u00e9", "é".encode())  # the standard library's escapes for exactly the three


def test_cpu_per_token_from_two_status_readings():
    before = {"process": {"cpu_s": 10.0, "loop_cpu_s": 1.0, "workers_cpu_s": 0.0}}
    after = {"process": {"cpu_s": 14.0, "loop_cpu_s": 1.5, "workers_cpu_s": 2.0}}
    got = cpu_per_token(before, after, 1000, client_cpu_s=0.25)
    assert got == {"daemon_cpu_s_per_token": 0.006, "daemon_loop_cpu_s_per_token": 0.0005,
                   "client_cpu_s_per_token": 0.00025, "daemon_cpu_s": 6.0}
    assert cpu_per_token({}, after, 1000)["daemon_cpu_s_per_token"] is None  # a daemon without the section


def test_a_steps_inter_token_gaps_are_observed_once_per_distinct_gap():
    """Metrics.on_step runs on the engine thread between steps: 48 streams' inter-token gaps, mostly one
    value (the previous step's time), go into the ITL/TPOT histograms as one weighted observation each,
    and the histograms read as if every stream's gap had been observed on its own."""
    from prometheus_client import CollectorRegistry, Histogram

    from gpuservd.api.metrics import TPOT_BUCKETS, Metrics, observe_n

    reg = CollectorRegistry()
    one, many = (Histogram(n, n, ["m"], buckets=TPOT_BUCKETS, registry=reg).labels("a") for n in ("one", "many"))
    for amount, n in ((0.03, 48), (0.2, 1), (99.0, 3)):
        observe_n(many, amount, n)
        for _ in range(n):
            one.observe(amount)
    samples = {(s.name.replace("many", "one"), tuple(s.labels.items())): s.value
               for f in reg.collect() for s in f.samples if s.name.startswith("many")}
    for f in reg.collect():
        for s in f.samples:
            if s.name.startswith("one") and not s.name.endswith("_created"):
                assert abs(samples[(s.name, tuple(s.labels.items()))] - s.value) < 1e-9, s

    m = Metrics()
    m.add_model("m")
    rec = SimpleNamespace(wall_s=0.05, decision_s=0.001, num_preempted=0, preemptions=[],
                          num_prefix_query_tokens=0, swaps=[])
    outs = [RequestOutput(f"r{i}", [5], "x", False, None, 10, 5, 0.0, None, None) for i in range(48)]
    m.on_step("m", rec, outs)
    calls = []
    series = m._series["m"]
    for name in ("itl", "tpot"):
        child = getattr(series, name)
        child.observe = lambda v, _o=child.observe: (calls.append(v), _o(v))
    m.on_step("m", rec, outs)
    assert calls == []  # one weighted observation, not 2 x 48 observe() calls
    counts = {f.name: s.value for f in m.registry.collect() for s in f.samples if s.name.endswith("_count")}
    assert counts["vllm:inter_token_latency_seconds"] == 48
    assert counts["vllm:time_per_output_token_seconds"] == 48


def test_a_busy_engines_snapshot_renews_its_status_dicts_now_and_then_and_idle_at_once(tiny_model_dir,
                                                                                          monkeypatch):
    """The loop's heartbeat snapshot is made between every two steps; its preemption, decode and prefix-cache
    dicts (a fraction of a ms at a full batch) are renewed every DETAIL_EVERY_S while busy, fresh when idle."""
    from gpuservd.engine import loop as engine_loop

    monkeypatch.setattr(engine_loop, "DETAIL_EVERY_S", 3600.0)  # no renewal by the clock during the run
    aloop = _RecordingLoop()
    done = threading.Event()
    finished = []

    class Sink:
        def put(self, item):
            if isinstance(item, RequestOutput) and item.finished:
                finished.append(item)
                if len(finished) == 4:
                    done.set()

    loop = EngineLoop("tiny", lambda: make_engine(tiny_model_dir), aloop, lambda d, e: [s.put(i) for s, i in d])
    for i in range(4):
        loop.submit(Submission(f"r{i}", [3 + i, 4, 5, 6], SamplingParams(max_tokens=40, ignore_eos=True), Sink()))
    loop.start()
    try:
        loop.ready.result(120)
        engine = loop.engine
        made = []
        status = engine.preemption_status
        engine.preemption_status = lambda: (made.append(engine.has_unfinished()), status())[1]
        assert done.wait(120)
        deadline = time.monotonic() + 10
        while not (made and not made[-1]) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    steps = engine.telemetry.num_steps
    busy = [m for m in made if m]
    assert steps >= 40 and len(busy) <= 1  # at most the renewal due when the run began
    assert made and made[-1] is False  # renewed once the engine had nothing left
    assert loop.snapshot.prefix_cache == engine.prefix_cache_status()

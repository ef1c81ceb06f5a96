"""sharing_contention fired by two real models time-sliced by the daemon's arbiter on the CPU (the daemon's
Serving in-process: real engines, the real arbiter on the wall clock, every event on the bus reaching the
HintMonitor, and the daemon's own evaluation, `serving.hints.tick(serving)`).

The traffic: `chat` gets a request alone, then one while `batch` works on a long request (cancelled once
chat's is done), several times over, so chat's steps alone and beside the neighbour interleave and see the
same machine.

Why the condition is certain and not a matter of how busy or fast the machine is: on a CPU every model is in
one time-sliced group, so a best-effort model whose 50 ms quantum runs out between two layers waits, inside
its step, for its neighbour's turn, and chat's request beside the neighbour is sized in the machine's own
step time to outlast the credit chat brings from its idle spell (SHARED_CHAT_S). With shares 0.2 and 0.8
that turn lasts until the neighbour's virtual time (run time / share) catches up: about 4 quanta, which the arbiter measures on the wall clock, so a slower
machine only lengthens it. Such a step is shared (the neighbour steps during it) and takes over 200 ms
where chat's short steps alone take about 10, so P99 shared / P99 alone is far above 2 at any machine
speed. The test checks that cause in the records: the slowest shared step holds the handoffs to the
neighbour and back.

The quiet window is the hint's own advice: chat declared latency_critical. Within its share it goes first
and never gives way in the middle of its work (the neighbour is cut at its next layer instead), so its steps
beside the neighbour cost what they cost alone. Within its share: chat has all of it (1.0; batch the
rest, nothing) and the neighbour runs 40 steps alone after each of chat's requests there, so chat's usage
average stays under 1 even with its long holds on a loaded machine (over its share a latency-critical
model takes turns too, by design). Its requests carry a 236-token prompt (prefix caching
off), so on both sides the P99 is a prefill step of a few hundred ms, not whichever 10 ms step a loaded
machine delayed by 50; as a best-effort model that prefill would wait for the neighbour's turns inside
its steps and fire the rule. The models are larger than the last level cache (42 MB of weights against
32 MiB here), as real models are: a model that fits in cache pays on its first step after the neighbour ran
for the weights the neighbour evicted, a real contention the rule rightly flags, but not the one this
window is about.

timeslice_overhead is fed here (real time_slice events between the two engines) and quiet at this
quantum; why a CPU cannot make it fire is in gpuservd/hints/rules_device.py.
"""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from gpuservd.hints.rule import Thresholds
from gpuservd.hints.window import pct
from inprocess_app import run_in_app

CHAT_TOKENS = 14  # each chat request: a prefill and 13 decode steps, one request at a time
LONG_PROMPT = "the capital of france is paris and the capital of italy is rome " * 9  # a prefill of 236 tokens
# The firing side's request beside the neighbour lasts this long in chat's own steps (at its step time alone,
# measured in the run). Arriving after an idle spell, chat is credited up to VTIME_BOUND_QUANTA quanta of
# virtual time against batch (0.5 s at share 0.2 and 50 ms quanta: about 0.1 s of its running) and keeps
# the device until that credit is spent; a request shorter than the credit, as 14 tokens are on a machine
# twice as fast as this one, never gives way in the middle of its work and its steps beside batch cost what
# they cost alone. Three times the credit in the machine's own step time makes it give way on any machine;
# at most SHARED_CHAT_TOKENS, so that batch, which steps 4-5 times as often meanwhile (shares 0.8 / 0.2: 350-460
# steps beside chat's 77-95 here), is still busy when chat's request ends.
SHARED_CHAT_S = 0.3
SHARED_CHAT_TOKENS = 100
NEIGHBOUR_TOKENS = 1500  # far more than it can do while one chat request runs; it is cancelled after that
# The rule reads the step records of its last step_span_s seconds; on a loaded machine the traffic can last
# longer than that, so the test counts and compares only what the rule saw (the traffic stops once that span,
# less a margin for the last cycle, holds enough steps of each kind).
SPAN_S = Thresholds().step_span_s


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory):
    """A small Llama of 16 layers: its forward is most of its step, so a quantum that runs out during a step
    mostly runs out between two layers (inside the step record) rather than between two steps; 42 MB of
    fp32 weights, more than the last level cache holds; 2048 positions for the neighbour's long request."""
    from factories import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("deep-llama"), num_hidden_layers=16, hidden_size=256,
                          intermediate_size=512, max_position_embeddings=2048)


@pytest.fixture
def two_models(tmp_path, monkeypatch, deep_model_dir):
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path))
    from gpuservd.store.store import ModelStore

    for name in ("chat", "batch"):
        ModelStore().import_dir(deep_model_dir, name)
    return tmp_path


def config(chat: dict, batch: dict) -> dict:
    # bandwidth priority off: the time slices alone decide who runs (its throttle paces the neighbour too)
    # prefix caching off: every chat request prefills its whole prompt
    return {"engine": {"kv_cache_bytes": "32MiB", "block_size": 16, "num_threads": 1, "prefix_caching": False},
            "server": {"models": ["chat", "batch"]},
            "sharing": {"quantum_ms": 50, "bandwidth_priority": False, "models": {"chat": chat, "batch": batch}}}


def within(events: list[dict], since: float) -> list[dict]:
    return [e for e in events if e.get("t", since) >= since]


def enough_steps(events: list[dict]) -> bool:
    """A verdict is possible: within the rule's span (less 5 s for the cycle still to come) chat has 20 steps
    beside the neighbour and 20 alone."""
    recent = within(events, time.time() - SPAN_S + 5)
    shared, alone = split(steps(recent, "chat"), steps(recent, "batch"))
    return len(shared) >= 20 and len(alone) >= 20


def traffic(result: dict, cycles: int, prompt: str, neighbour_after: int = 0, shared_chat_s: float = 0.0):
    """`cycles` times: a chat request alone, then one while batch has a long request running (cancelled once
    chat's is done and batch has made neighbour_after more steps alone); with shared_chat_s, chat's request
    beside batch asks for as many tokens as its decode steps alone (the median so far) take in that time,
    CHAT_TOKENS at least; more cycles (up to 3 times as many)
    while the records do not yet hold enough steps of each kind, as on a loaded machine where fewer of
    chat's steps fall inside one of batch's. result gets the active hints, the rules' status and the events
    the bus carried."""
    async def check(client, serving):
        events: list[dict] = []
        serving.bus.taps.append(lambda e: events.append(e if isinstance(e, dict) else e.to_json()))

        def count(kind: str, model: str) -> int:
            return sum(1 for e in list(events) if e["type"] == kind and e.get("model") == model)

        async def ask(model: str, tokens: int):
            r = await client.post("/v1/completions", json={"model": model,
                                                           "prompt": prompt if model == "chat" else "a long job",
                                                           "max_tokens": tokens, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        async def cancel_batch():
            listed = (await client.get("/admin/requests")).json()["requests"]
            for rid in [q["request_id"] for q in listed if q["model"] == "batch"]:
                assert (await client.post(f"/admin/requests/{rid}/cancel")).status_code == 200

        async def until(done):
            while not done():
                await asyncio.sleep(0.002)

        def shared_tokens() -> int:
            if not shared_chat_s:
                return CHAT_TOKENS
            decodes = sorted(e["wall_s"] for e in list(events)
                             if e["type"] == "step" and e["model"] == "chat" and not e["num_prefill_tokens"])
            return max(CHAT_TOKENS, min(SHARED_CHAT_TOKENS, math.ceil(shared_chat_s / decodes[len(decodes) // 2])))

        for i in range(3 * cycles):
            if i >= cycles and enough_steps(events):
                break
            await ask("chat", CHAT_TOKENS)
            stepped = count("step", "batch")
            job = asyncio.ensure_future(ask("batch", NEIGHBOUR_TOKENS))
            await until(lambda: job.done() or count("step", "batch") > stepped)  # the neighbour is stepping
            assert not job.done(), job.result()
            await ask("chat", shared_tokens())
            stepped = count("step", "batch")
            await until(lambda: job.done() or count("step", "batch") >= stepped + neighbour_after)
            await cancel_batch()  # the neighbour's job ends with chat's request
            assert (await job)["choices"][0]["finish_reason"] == "abort"
        since = time.time() - SPAN_S  # nothing steps now: the tick's own clock reads the same span
        serving.hints.tick(serving)  # the daemon's evaluation
        result["hints"] = {(h["name"], h["model"]): h for h in serving.hints.hints()}
        result["rules"] = {r["name"]: r for r in serving.hints.rule_status()}
        result["events"] = within(list(events), since)  # what the rule's window held

    return check


def steps(events: list[dict], model: str) -> list[dict]:
    return [e for e in events if e["type"] == "step" and e["model"] == model]


def split(mine: list[dict], others: list[dict]) -> tuple[list[dict], list[dict]]:
    """Steps that overlap a neighbour's step, and those that do not (by brute force: the rule bisects)."""
    shared, alone = [], []
    for s in mine:
        a, b = s["t"] - s["wall_s"], s["t"]
        (shared if any(o["t"] - o["wall_s"] < b and o["t"] > a for o in others) else alone).append(s)
    return shared, alone


def p99_ms(steps_: list[dict]) -> float:
    return round(1000 * pct([s["wall_s"] for s in steps_], 99), 3)


def handoffs_within(events: list[dict], step: dict) -> list[tuple[str, str]]:
    a, b = step["t"] - step["wall_s"], step["t"]
    return [(e["model"], e["next"]) for e in events if e["type"] == "time_slice" and a <= e["t"] <= b]


def test_a_best_effort_model_beside_a_heavier_neighbour_fires_sharing_contention(two_models):
    got: dict = {}
    run_in_app(traffic(got, 8, "hello there", shared_chat_s=SHARED_CHAT_S), config({"share": 0.2, "class": "best_effort"},
                                            {"share": 0.8, "class": "best_effort"}), load=["chat", "batch"])
    events = got["events"]
    chat, batch = steps(events, "chat"), steps(events, "batch")
    shared, alone = split(chat, batch)
    assert ("sharing_contention", "chat") in got["hints"], (
        f"no hint: {len(shared)} shared steps (P99 {p99_ms(shared) if shared else '-'} ms), {len(alone)} alone "
        f"(P99 {p99_ms(alone) if alone else '-'} ms) in the rule's last {SPAN_S} s")
    hint = got["hints"][("sharing_contention", "chat")]
    ev = hint["evidence"]
    assert ev["neighbours"] == "batch"
    assert (ev["num_steps_shared"], ev["num_steps_alone"]) == (len(shared), len(alone))
    assert len(shared) >= 20 and len(alone) >= 20
    assert (ev["p99_shared_ms"], ev["p99_alone_ms"]) == (p99_ms(shared), p99_ms(alone))
    assert ev["ratio"] >= 2.0
    assert "throttle the neighbour (batch)" in hint["action"] and hint["symptom"] and hint["cause"]
    # the time slices' own rule reads these same handoffs: fed, and quiet at a 50 ms quantum
    assert got["rules"]["timeslice_overhead"]["fed"] and ("timeslice_overhead", None) not in got["hints"]
    assert sum(1 for e in events if e["type"] == "time_slice") >= 20
    # The cause, in the records: the slowest shared steps gave the device to the neighbour in the middle and
    # got it back before they ended (they waited for batch's turn inside the step).
    slowest = sorted(shared, key=lambda s: s["wall_s"])[-max(1, len(shared) // 100):]
    for s in slowest:
        inside = handoffs_within(events, s)
        assert ("chat", "batch") in inside and ("batch", "chat") in inside, inside


def test_the_model_declared_latency_critical_is_quiet_beside_the_same_neighbour(two_models):
    got: dict = {}
    run_in_app(traffic(got, 8, LONG_PROMPT, neighbour_after=40),
               config({"share": 1.0, "class": "latency_critical"}, {"class": "best_effort"}),
               load=["chat", "batch"])
    events = got["events"]
    chat, batch = steps(events, "chat"), steps(events, "batch")
    shared, alone = split(chat, batch)
    # a verdict was possible: enough steps beside the neighbour and alone
    assert len(shared) >= 20 and len(alone) >= 20
    assert p99_ms(shared) < 2 * p99_ms(alone)
    assert ("sharing_contention", "chat") not in got["hints"]
    assert got["rules"]["sharing_contention"]["fed"]
    # why: chat gave the device up only when it had nothing left to do, never in the middle of its work;
    # the neighbour, busy, gave way to it
    slices = [e for e in events if e["type"] == "time_slice"]
    assert {e["reason"] for e in slices if e["model"] == "chat"} == {"idle"}
    assert any(e["model"] == "batch" and e["next"] == "chat" and e["reason"] != "idle" for e in slices)
    assert not any(("chat", "batch") in handoffs_within(events, s) for s in chat)

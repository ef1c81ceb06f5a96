"""ConsoleState over the event stream recorded from the real daemon (tests/console_fixtures/stream.ndjson).

The recording was made by tests/console_fixtures/record_stream.py: gpuservd
on a tiny model with a 256-block KV pool and eight concurrent long requests,
so it holds step records, preemptions and a request list with preempted
requests. Swap, hint and restart events are added by hand where a test needs
them, in the shapes the daemon is expected to send (see console.state).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from console.feed import ReplayFeed
from console.state import LATENCY_WINDOW, ConsoleState, percentile

STREAM = Path(__file__).parent / "console_fixtures" / "stream.ndjson"


def records() -> list[dict]:
    return [json.loads(line) for line in STREAM.read_text().splitlines() if line.strip()]


def replayed() -> ConsoleState:
    state = ConsoleState()
    asyncio.run(ReplayFeed(state, STREAM).run())
    return state


def test_latency_window_is_the_recorded_steps():
    state = replayed()
    steps = [r["data"] for r in records() if r["source"] == "event" and r["data"]["type"] == "step"]
    window = [s["wall_s"] * 1000 for s in steps][-LATENCY_WINDOW:]
    (view,) = state.model_views()
    assert view.name == "tiny" and view.num_steps == len(window)
    assert view.p50_ms == percentile(window, 50) > 0
    assert view.p99_ms == percentile(window, 99) >= view.p50_ms
    assert view.latency_ms == window
    assert view.tokens_per_s > 0
    last_status = [r["data"] for r in records() if r["source"] == "status"][-1]["models"][0]
    assert view.kv_total == last_status["kv_blocks_total"]
    assert view.kv_used == last_status["kv_blocks_total"] - last_status["kv_blocks_free"]
    assert set(view.part_p50_ms) == {"forward", "sample", "scheduler"}


def test_percentile_nearest_rank():
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile(list(range(1, 101)), 99) == 99


def test_preemptions_from_the_daemon_not_doubled():
    state = replayed()
    daemon_events = [r["data"] for r in records() if r["source"] == "event" and r["data"]["type"] == "preemption"]
    assert daemon_events, "the recording must hold preemptions"
    logged = state.log("preemption")
    assert [(e["step_id"], e["request_ids"]) for e in logged] == [(e["step_id"], e["request_ids"]) for e in daemon_events]
    assert not any(e.get("derived") for e in logged)


def test_preemption_derived_from_a_step_when_the_daemon_sends_no_event():
    state = ConsoleState()
    step = next(r["data"] for r in records() if r["source"] == "event" and r["data"].get("num_preempted"))
    state.ingest(step)
    (entry,) = state.log("preemption")
    assert entry["derived"] and entry["request_ids"] == step["preempted_ids"]
    before = state.num_log_edits
    state.ingest({"type": "preemption", "t": step["t"], "model": step["model"], "step_id": step["step_id"],
                  "num_preempted": 1, "request_ids": step["preempted_ids"], "kind": "recompute", "seconds": 0.01})
    (entry,) = state.log("preemption")
    assert not entry.get("derived") and entry["kind"] == "recompute"
    assert state.num_log_edits == before + 1


def test_data_the_daemon_does_not_report_stays_none():
    state = replayed()
    assert state.swap_rates() == {"out": 0.0, "in": 0.0}  # reported (steps carry `swaps`), none in the recording
    assert ConsoleState().swap_rates() is None
    assert state.hints() is None
    assert state.device_readings() is None


def test_swap_events_give_rates():
    """The daemon's shapes: a "swap" event per KV move (kind swap_out / swap_in), a `swaps` list on the step."""
    state = ConsoleState(clock=lambda: 100.0)
    state.ingest({"type": "step", "model": "m", "t": 94.0, "wall_s": 0.01, "swaps": []})
    assert state.swap_rates() == {"out": 0.0, "in": 0.0}  # reported, and idle
    state.ingest({"type": "swap", "t": 95.0, "model": "m", "kind": "swap_out", "request_id": "r1",
                  "bytes_moved": 10 * 1024 * 1024, "seconds": 0.2})
    state.ingest({"type": "swap", "t": 99.0, "model": "m", "kind": "swap_in", "request_id": "r1",
                  "bytes_moved": 5 * 1024 * 1024, "seconds": 0.1})
    state.ingest({"type": "swap_in", "t": 50.0, "model": "m", "bytes": 999})  # outside the window
    assert state.swap_rates() == {"out": 1024 * 1024.0, "in": 512 * 1024.0}
    assert [e["type"] for e in state.log("swap")] == ["swap", "swap", "swap_in"]


def test_victims_cost_is_shown():
    from console.screens.events import describe

    e = {"type": "preemption", "t": 1.0, "model": "m", "step_id": 7, "num_preempted": 2, "request_ids": ["a", "b"],
         "victims": [{"kind": "swap", "request_id": "a", "reason": "memory", "blocks_freed": 4,
                      "tokens_to_recompute": 0, "bytes_moved": 2 * 1024 * 1024, "bytes_parked": 0, "seconds": 0.003},
                     {"kind": "recompute", "request_id": "b", "reason": "displaced", "blocks_freed": 2,
                      "tokens_to_recompute": 40}]}
    assert describe(e) == "step 7: 2 preempted: a swap 2.0 MiB 3.0 ms (memory); b recompute 40 tok (displaced)"


def test_hints_from_events_follow_their_state():
    state = ConsoleState()
    state.ingest({"type": "hint", "t": 1.0, "name": "hbm_bound", "active": True, "evidence": "P99 3x P50"})
    state.ingest({"type": "hint", "t": 2.0, "name": "queue_growth", "active": True, "evidence": "waiting 40"})
    state.ingest({"type": "hint", "t": 3.0, "name": "queue_growth", "active": False})
    assert [h["name"] for h in state.hints()] == ["hbm_bound"]


def test_restart_is_detected_by_pid_and_said():
    state = replayed()
    state.set_connection("connected", "/s", pid=1)
    state.set_connection("disconnected", "/s", "no daemon answers")
    assert state.connection.state == "disconnected"
    state.set_connection("connected", "/s", pid=2)
    assert "restarted (pid 1 -> 2)" in state.connection.message
    assert state.model_views()[0].num_steps == 0  # the old daemon's steps are gone
    messages = [e["message"] for e in state.log("console")]
    assert messages[-2].startswith("no daemon answers") and "restarted" in messages[-1]


def test_log_since_returns_only_new_entries():
    state = replayed()
    n = state.num_logged
    assert state.log_since(n) == []
    state.ingest({"type": "model_unload", "t": 1.0, "model": "tiny", "num_aborted": 0})
    assert [e["type"] for e in state.log_since(n)] == ["model_unload"]


def test_request_rows_sort_and_filter_with_missing_fields():
    from console.screens.requests import filter_rows, sort_rows

    rows = [{"request_id": "a", "state": "running", "num_output_tokens": 5},
            {"request_id": "b", "state": "tokenizing"},  # not in the engine yet: no token count
            {"request_id": "c", "state": "preempted", "num_output_tokens": 9, "model": "tiny"}]
    assert [r["request_id"] for r in sort_rows(rows, "num_output_tokens", True)] == ["c", "a", "b"]
    assert [r["request_id"] for r in sort_rows(rows, "model", False)] == ["a", "b", "c"]
    assert [r["request_id"] for r in filter_rows(rows, "tiny pre")] == ["c"]


def test_dashboard_shows_the_prefix_cache_hit_rate():
    from console.screens.dashboard import prefix_cache_lines

    on = {"name": "m", "prefix_cache": {"enabled": True, "query_tokens": 1200, "hit_tokens": 996, "cached_blocks": 40}}
    assert prefix_cache_lines(on) == ["m: prefix cache 83% hit (996 of 1200 tokens), 40 blocks"]
    assert prefix_cache_lines({"name": "m", "prefix_cache": {"enabled": False}}) == ["m: prefix cache off"]
    assert prefix_cache_lines({"name": "m"}) == []  # an older daemon: nothing said

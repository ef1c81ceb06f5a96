"""The console driven through Textual's pilot against the event stream recorded from the real daemon.

Every screen is opened by its key and checked for what the recording holds;
the actions that would change the daemon are refused (a recording is
read-only) after their confirmation dialog. The live daemon is driven in
test_console_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from console.app import MAX_HZ, ConsoleApp
from console.screens.dialogs import ConfirmScreen, HelpScreen, PromptScreen
from console.widgets import NOT_REPORTED

STREAM = Path(__file__).parent / "console_fixtures" / "stream.ndjson"
ROOT = Path(__file__).resolve().parent.parent


def text_of(app, selector: str) -> str:
    return str(app.screen.query_one(selector).content)


def table_rows(app, selector: str) -> list[list[str]]:
    table = app.screen.query_one(selector)
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def records() -> list[dict]:
    return [json.loads(x) for x in STREAM.read_text().splitlines() if x.strip()]


def recorded_requests() -> list[dict]:
    return [r["data"] for r in records() if r["source"] == "requests"][-1]


pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def app():
    return ConsoleApp.replay(STREAM)


async def test_dashboard_shows_the_recorded_latency_and_what_is_not_reported(app):
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        latency = text_of(app, "#latency")
        assert "tiny" in latency and "P50" in latency and "P99" in latency and "tok/s" in latency
        assert "P50 - ms" not in latency
        assert "KV [" in latency
        assert "cmpl-" in text_of(app, "#preempt")
        assert "out 0 B/s  in 0 B/s" in text_of(app, "#swap") and "host 0/" in text_of(app, "#swap")
        assert NOT_REPORTED in text_of(app, "#hints")
        assert "unavailable" in text_of(app, "#device")
        bar = str(app.screen.query_one(".status-bar").content)
        assert "replay" in bar and "[1 Dashboard]" in bar


async def test_every_screen_by_its_key(app):
    async with app.run_test(size=(80, 24)) as pilot:
        for key, mode, marker in [("2", "requests", "#requests"), ("3", "models", "#models"),
                                  ("4", "partitions", "#sm"), ("5", "events", "#events"), ("1", "dashboard", "#latency")]:
            await pilot.press(key)
            await pilot.pause()
            assert app.current_mode == mode
            assert app.screen.query_one(marker) is not None
        await pilot.press("4")
        await pilot.pause()
        for panel in ("#sm", "#quotas", "#arbiter"):
            assert NOT_REPORTED in text_of(app, panel)


async def test_help_opens_and_closes(app):
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_requests_table_filters_and_sorts(app):
    want = recorded_requests()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        rows = table_rows(app, "#requests")
        assert len(rows) == len(want)
        await pilot.press("slash", *"preempted", "enter")
        await pilot.pause()
        rows = table_rows(app, "#requests")
        assert len(rows) == sum(r["state"] == "preempted" for r in want) > 0
        assert all(r[4] == "preempted" for r in rows)
        await pilot.press("slash", *["backspace"] * 9, "enter")
        await pilot.press("s")  # age -> generated tokens, largest first
        await pilot.pause()
        gen = [int(r[6]) for r in table_rows(app, "#requests")]
        assert gen == sorted(gen, reverse=True)
        await pilot.press("S")
        await pilot.pause()
        gen = [int(r[6]) for r in table_rows(app, "#requests")]
        assert gen == sorted(gen)
        assert "not reported" in text_of(app, "#request-detail")  # the daemon has no per-request queue wait


async def test_cancel_asks_first_and_a_recording_refuses(app):
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("2", "c")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmScreen)
        assert not app._notifications
        await pilot.press("c", "y")
        await pilot.pause()
        await app.workers.wait_for_complete()
        assert any("recording" in n.message for n in app._notifications)


async def test_models_screen_and_its_dialogs(app):
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("3")
        await pilot.pause()
        (row,) = table_rows(app, "#models")
        assert row[:3] == ["tiny", "ready", "no"]
        cache = text_of(app, "#cache")
        assert "last load: ready" in cache and NOT_REPORTED in cache
        await pilot.press("u")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("escape")
        await pilot.press("p")
        assert "Pin tiny?" in app.screen.question
        await pilot.press("n", "l")
        assert isinstance(app.screen, PromptScreen)
        await pilot.press("escape")
        assert app.current_mode == "models" and not app._notifications


async def test_events_log_filters_by_kind(app):
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("5")
        await pilot.pause()
        kinds = {r[1] for r in table_rows(app, "#events")}
        assert {"preemption", "model_load", "request_finished"} <= kinds
        assert "step" not in kinds
        while app.screen.kind != "preemption":
            await pilot.press("f")
        await pilot.pause()
        rows = table_rows(app, "#events")
        assert rows and all(r[1] == "preemption" for r in rows)
        assert all("cmpl-" in r[3] for r in rows)
        assert "kind: preemption" in str(app.screen.query_one("#events-filter").content)


async def test_redraws_only_on_change_and_at_most_4_hz():
    app = ConsoleApp.replay(STREAM, refresh_hz=100)
    assert app.refresh_s == 1 / MAX_HZ
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        app.tick()
        n = app.num_redraws
        app.tick()
        app.tick()
        assert app.num_redraws == n  # nothing changed: nothing redrawn
        app.state.ingest({"type": "model_pin", "t": 1.0, "model": "tiny", "pinned": True})
        app.tick()
        assert app.num_redraws == n + 1


async def test_no_color_and_a_wide_terminal(monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    app = ConsoleApp.replay(STREAM)
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        assert app.no_color
        assert app.screen.has_class("-wide")
        last = [r["data"] for r in records() if r["source"] == "event" and r["data"]["type"] == "preemption"][-1]
        assert f"step {last['step_id']} {last['request_ids'][0]}" in text_of(app, "#preempt")  # wide: ids in full


def test_console_imports_no_torch_nor_the_engine():
    code = (
        "import sys, asyncio\n"
        "from console.app import ConsoleApp\n"
        "import console.cli, gpuservd.cli.top_cmd\n"
        f"app = ConsoleApp.replay({str(STREAM)!r})\n"
        "async def go():\n"
        "    async with app.run_test(size=(80, 24)) as pilot:\n"
        "        await pilot.press('2', '3', '5')\n"
        "asyncio.run(go())\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy', 'safetensors',\n"
        "                                                         'starlette', 'uvicorn')\n"
        "             or m.startswith(('gpuservd.engine', 'gpuservd.runner', 'gpuservd.kv_cache', 'gpuservd.serving',\n"
        "                              'gpuservd.models', 'gpuservd.weights', 'gpuservd.worker')))\n"
        "print(bad)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


async def test_requests_detail_says_what_sampling_applies(tmp_path):
    recs = records()
    for r in recs:
        if r["source"] == "requests":
            for row in r["data"]:
                row["sampling"] = "t=0.7 top_p=0.9 seed=3 logprobs=5 json_schema (response_format)"
    stream = tmp_path / "stream.ndjson"
    stream.write_text("".join(json.dumps(r) + "\n" for r in recs))
    app = ConsoleApp.replay(stream)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("2")
        await pilot.pause()
        assert "sampling: t=0.7 top_p=0.9 seed=3 logprobs=5 json_schema (response_format)" in \
            text_of(app, "#request-detail")

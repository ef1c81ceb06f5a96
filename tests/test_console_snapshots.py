"""Snapshot tests (pytest-textual-snapshot): the layout of every screen at 80x24 and 160x48, help, NO_COLOR.

The console shows the event stream recorded from the real daemon
(tests/console_fixtures/stream.ndjson); a replay pins the clock to the end of
the recording, so every number on screen is fixed. Update after a deliberate
layout change with `pytest tests/test_console_snapshots.py --snapshot-update`
and look at the SVGs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from console.app import ConsoleApp

# Relative to the tests folder (each test runs there): the header shows the replayed file, and an
# absolute path would tie the snapshots to one checkout's location.
STREAM = Path("console_fixtures") / "stream.ndjson"
SIZES = [(80, 24), (160, 48)]


@pytest.fixture(autouse=True)
def in_tests_dir(monkeypatch):
    monkeypatch.chdir(Path(__file__).parent)


def settled(*keys: str):
    """run_before: let the replay finish, redraw once, then press the keys."""

    async def run_before(pilot) -> None:
        await pilot.app.workers.wait_for_complete()
        pilot.app.tick()
        await pilot.pause()
        for key in keys:
            await pilot.press(key)
            await pilot.pause()

    return run_before


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("key", ["1", "2", "3", "4", "5"],
                         ids=["dashboard", "requests", "models", "partitions", "events"])
def test_screen_layout(snap_compare, key, size):
    assert snap_compare(ConsoleApp.replay(STREAM), terminal_size=size, run_before=settled(key))


def test_help_at_80x24(snap_compare):
    assert snap_compare(ConsoleApp.replay(STREAM), terminal_size=(80, 24), run_before=settled("question_mark"))


def test_dashboard_no_color(snap_compare, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    assert snap_compare(ConsoleApp.replay(STREAM), terminal_size=(80, 24), run_before=settled("1"))

"""The console against the real daemon: through Textual's pilot, and in a real terminal through tmux.

One daemon (tiny model, a 256-block KV pool: see console_fixtures/workload.py)
serves the module. A burst of long concurrent requests makes it preempt; the
console must show non-zero step latency, list the preemption in its event log,
and cancel a request in the daemon from the requests screen. The daemon is
then restarted under the console, which must reconnect and say so. The tmux
test drives `python -m console` the way an operator would over SSH.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import httpx
import pytest
from typer.testing import CliRunner

from console.app import ConsoleApp
from console.screens.dialogs import ConfirmScreen
from console_fixtures.workload import SQUEEZED, burst
from daemon_harness import ROOT, DaemonProcess, make_home, wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("console-e2e")
    d = DaemonProcess(tmp, make_home(tmp, tiny_model_dir), config=SQUEEZED)
    d.home = tmp / "home"
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop(wait_exit=False)


def in_flight(daemon) -> list[dict]:
    with daemon.http() as c:
        return c.get("/admin/requests").json()["requests"]


@pytest.fixture
def long_burst(daemon):
    """24 requests of 9 + 1000 tokens in a 1024-token pool: they preempt each other, and once a request
    has been preempted max_preemptions times it runs to its end alone, so the burst lasts ~15 s here
    (eight requests were done in 5 s); whatever is left is cancelled afterwards so the next test has
    the CPU."""
    burst(daemon.socket, n=24, max_tokens=1000)
    yield
    with daemon.http() as c:
        for r in in_flight(daemon):
            c.post(f"/admin/requests/{r['request_id']}/cancel")
    wait_until(lambda: not in_flight(daemon), timeout=20, what="the burst to be cancelled")


async def until(pilot, predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what() if callable(what) else what}")
        await pilot.pause(0.1)


async def test_latency_preemption_and_cancel_through_the_pilot(daemon, long_burst):
    app = ConsoleApp.live(daemon.socket, refresh_hz=4)
    async with app.run_test(size=(100, 30)) as pilot:
        def latency_shown():
            return re.search(r"P50 [0-9.]+ ms", str(app.screen.query_one("#latency").content))

        await until(pilot, latency_shown, what="non-zero step latency on the dashboard")
        assert app.state.model_views()[0].p50_ms > 0
        assert "connected" in str(app.screen.query_one(".status-bar").content)

        await pilot.press("5")

        def preemption_row():
            table = app.screen.query_one("#events")
            return any(str(table.get_row_at(i)[1]) == "preemption" for i in range(table.row_count))

        await until(pilot, preemption_row, what="a preemption in the event log")

        await pilot.press("2")
        notes = lambda: [n.message for n in app._notifications]  # noqa: E731
        # The victim is certain to be in flight when the cancel lands: eight requests of 1000 tokens go ahead
        # of it at a higher priority, and the pool holds one of them at a time (they take turns by
        # preemption), so it waits in the queue until they are all done (priority is never crossed by
        # remaining work or age: engine/policy.py), seconds even on a fast machine. A request already running
        # may end between the screen's refresh and the cancel.
        before = {r["request_id"] for r in in_flight(daemon)}
        burst(daemon.socket, n=8, max_tokens=1000)
        await until(pilot, lambda: len({r["request_id"] for r in in_flight(daemon)} - before) >= 8,
                    what="the eight requests ahead of the victim")
        burst(daemon.socket, n=1, max_tokens=1000, priority=-1)

        def victim_shown():
            return any(r.get("priority") == -1 for r in app.screen._shown)

        await until(pilot, victim_shown, what=lambda: f"the victim on screen ({len(in_flight(daemon))} in flight)")
        shown = app.screen._shown
        app.screen.query_one("#requests").move_cursor(row=min(range(len(shown)),
                                                               key=lambda i: shown[i].get("priority", 0)))
        await pilot.pause()
        victim = app.screen.selected()["request_id"]
        assert app.screen.selected().get("priority") == -1
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("y")
        await until(pilot, lambda: any(victim in m for m in notes()),
                    what=lambda: f"the cancel to be answered (notes: {notes()})")
        assert any(f"cancelled {victim}" in m for m in notes()), notes()
        # Polled with the app's loop running: a blocking wait here would freeze the console under test.
        await until(pilot, lambda: victim not in {r["request_id"] for r in in_flight(daemon)}, timeout=10,
                    what="the daemon to drop the cancelled request")
        await until(pilot, lambda: any(e.get("request_id") == victim for e in app.state.log("request_finished")),
                    what="the cancelled request's finish event")
        (finished,) = [e for e in app.state.log("request_finished") if e.get("request_id") == victim]
        assert finished["finish_reason"] == "abort"


def test_top_records_the_stream(daemon, tmp_path):
    from gpuservd.cli.main import app as cli

    out = tmp_path / "rec.ndjson"
    # A recording lasts what --seconds says; on a loaded machine the first status, requests and events
    # lines can take longer than a second to come, so a short one that missed some is taken again, longer.
    for seconds in ("1", "4", "15"):
        r = CliRunner().invoke(cli, ["top", "--socket", str(daemon.socket), "--record", str(out), "--seconds", seconds])
        assert r.exit_code == 0, r.output
        sources = {json.loads(line)["source"] for line in out.read_text().splitlines()}
        if sources == {"status", "requests", "event"}:
            break
    assert sources == {"status", "requests", "event"}
    r = CliRunner().invoke(cli, ["top", "--replay", str(tmp_path / "missing.ndjson")])
    assert "no recording" in str(r.exception)  # a UserError: main() prints it on one line, exit code 2


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed: the real-terminal test needs it")
def test_operator_in_tmux(daemon, long_burst, tmp_path):
    sock = tmp_path / "tmux.sock"
    tmux = ["tmux", "-S", str(sock)]
    cmd = f"cd {ROOT} && GPUSERV_SOCKET={daemon.socket} TERM=xterm-256color {sys.executable} -m console"
    subprocess.run(tmux + ["new-session", "-d", "-x", "100", "-y", "30", cmd], check=True)

    def screen() -> str:
        return subprocess.run(tmux + ["capture-pane", "-p"], capture_output=True, text=True).stdout

    def shows(text: str, timeout: float = 20.0) -> str:
        return wait_until(lambda: text in screen() and screen(), timeout=timeout, interval=0.2,
                          what=f"{text!r} on the tmux screen:\n{screen()}")

    try:
        shows("● connected")
        first = shows("P50")
        assert "Step latency" in first and "[1 Dashboard]" in first
        wait_until(lambda: re.search(r"P50 [0-9.]+ ms", screen()), timeout=20, interval=0.2, what="a step latency")
        subprocess.run(tmux + ["send-keys", "5"], check=True)
        assert "time UTC" in shows("[5 Events]")
        subprocess.run(tmux + ["send-keys", "?"], check=True)
        shows("Esc / ?: close")
        subprocess.run(tmux + ["send-keys", "Escape"], check=True)
        wait_until(lambda: "Esc / ?: close" not in screen(), timeout=10, interval=0.2, what="help to close")
        subprocess.run(tmux + ["send-keys", "2"], check=True)
        shows("[2 Requests]")
        subprocess.run(tmux + ["send-keys", "q"], check=True)
        wait_until(lambda: subprocess.run(tmux + ["has-session"], capture_output=True).returncode != 0, timeout=10,
                   interval=0.2, what="the console to quit")
    finally:
        subprocess.run(tmux + ["kill-server"], capture_output=True)


async def test_reconnects_and_says_so_when_the_daemon_restarts(daemon, tmp_path_factory):
    """Last in the module: it replaces the module's daemon with a new one on the same socket."""
    app = ConsoleApp.live(daemon.socket, refresh_hz=4)
    async with app.run_test(size=(100, 30)) as pilot:
        await until(pilot, lambda: app.state.connection.state == "connected", what="the first connection")
        old_pid = app.state.connection.pid
        daemon.stop()
        bar = lambda: str(app.screen.query_one(".status-bar").content)  # noqa: E731
        await until(pilot, lambda: "DISCONNECTED" in bar(), what="the console to say the daemon is gone")
        new = DaemonProcess(tmp_path_factory.mktemp("console-e2e-restart"), daemon.home, config=SQUEEZED,
                            socket_path=daemon.socket)
        try:
            new.wait_ready()
            await until(pilot, lambda: "restarted" in bar(), what="the console to say it reconnected")
            # the message itself, with both pids: the operator reads that the daemon was replaced, and by whom
            assert f"the daemon restarted (pid {old_pid} -> {new.proc.pid})" in bar(), bar()
            assert app.state.connection.pid == new.proc.pid != old_pid
            assert app.state.connection.state == "connected"
        finally:
            new.stop()

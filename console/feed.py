"""Feeds that fill a ConsoleState: the live daemon over its socket, or a recording of one.

`LiveFeed.run()` connects, reads `/admin/events` (replaying the recent steps
first) and polls `/admin/status` and `/admin/requests` once a second. When the
daemon goes away (a restart, a crash, a drain that exits) it says so in the
state, retries every second, and on reconnecting tells whether it is the same
daemon or a new one. Actions (cancel, load, unload, pin) go through the same
client.

`record()` writes what a LiveFeed sees to an NDJSON file (one
`{"source": "event" | "status" | "requests", "data": ...}` per line);
`ReplayFeed` plays such a file back into a state, read-only: an operator can
record an incident and look at it later, and the tests drive every screen with
a stream recorded from the real daemon.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

from gpuservd.api.client import LONG_TIMEOUT, AsyncClient, DaemonUnavailable

from gpuservd.paths import client_socket_path

from console.state import ConsoleState

POLL_S = 1.0  # status and requests poll period
RETRY_S = 1.0  # wait between reconnect attempts
RECENT_STEPS = 256  # steps per model replayed on connect (fills the latency window at once)
LINK_ERRORS = (DaemonUnavailable, httpx.HTTPError, OSError, json.JSONDecodeError)


class ReadOnly(Exception):
    """An action on a replayed recording."""


class LiveFeed:
    """The daemon at a Unix socket (None: the socket the CLI would find)."""

    def __init__(self, state: ConsoleState, socket_path: str | Path | None = None, poll_s: float = POLL_S,
                 sink=None):
        self.state = state
        self.socket_path = socket_path
        self.poll_s = poll_s
        self.sink = sink  # called with (source, data) for everything received (the recorder)
        self._client: AsyncClient | None = None

    @property
    def where(self) -> str:
        return str(self.socket_path or client_socket_path())

    async def run(self) -> None:
        """Forever: connect, follow, and on any loss say so and retry."""
        while True:
            client = self._client = AsyncClient(self.socket_path)
            try:
                await self._follow(client)
                why = "the daemon closed the event stream"
            except LINK_ERRORS as exc:
                why = ("no daemon answers (start one with `gpuserv serve`)" if isinstance(exc, DaemonUnavailable)
                       else f"lost the daemon ({type(exc).__name__})")
            finally:
                await client.aclose()
            self.state.set_connection("disconnected", client.where, f"retrying every {RETRY_S:.0f} s: {why}")
            await asyncio.sleep(RETRY_S)

    async def _follow(self, client: AsyncClient) -> None:
        status = await client.request("GET", "/admin/status")
        self._take("status", status)
        self.state.set_connection("connected", client.where, pid=status.get("pid"))
        tasks = [asyncio.ensure_future(self._events(client)), asyncio.ensure_future(self._poll(client))]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            task.result()  # raises the link error that ended it

    async def _events(self, client: AsyncClient) -> None:
        async for event in client.events(recent=RECENT_STEPS):
            self._take("event", event)

    async def _poll(self, client: AsyncClient) -> None:
        while True:
            self._take("requests", await client.requests())
            await asyncio.sleep(self.poll_s)
            self._take("status", await client.request("GET", "/admin/status"))

    def _take(self, source: str, data) -> None:
        if source == "event":
            self.state.ingest(data)
        elif source == "status":
            self.state.set_status(data)
        else:
            self.state.set_requests(data)
        if self.sink is not None:
            self.sink(source, data)

    # ---- actions (each raises DaemonError / DaemonUnavailable with a one-line message) ------------
    def _admin(self) -> AsyncClient:
        if self._client is None or self.state.connection.state != "connected":
            raise DaemonUnavailable(self.where)
        return self._client

    async def cancel(self, request_id: str) -> dict:
        return await self._admin().cancel(request_id)

    async def load(self, model: str) -> dict:
        return await self._admin().request("POST", f"/admin/models/{model}/load", {}, LONG_TIMEOUT)

    async def unload(self, model: str) -> dict:
        return await self._admin().request("POST", f"/admin/models/{model}/unload", {}, LONG_TIMEOUT)

    async def pin(self, model: str, pinned: bool) -> dict:
        return await self._admin().request("POST", f"/admin/models/{model}/pin", {"pinned": pinned})


class ReplayFeed:
    """A recording played back into the state at once; the clock stops where the recording ends."""

    def __init__(self, state: ConsoleState, path: str | Path):
        self.state = state
        self.path = Path(path)
        self.where = str(path)

    async def run(self) -> None:
        records = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        end = max((r["data"].get("t", 0) for r in records if r["source"] == "event"), default=0.0)
        self.state.clock = lambda: end
        pid = None
        for r in records:
            if r["source"] == "event":
                self.state.ingest(r["data"])
            elif r["source"] == "status":
                pid = r["data"].get("pid", pid)
                self.state.set_status(r["data"])
            else:
                self.state.set_requests(r["data"])
        self.state.set_connection("replay", self.where, "read-only", pid=pid)

    async def _read_only(self, *args) -> dict:
        raise ReadOnly("this is a recording; actions need the live daemon")

    cancel = load = unload = _read_only

    async def pin(self, model: str, pinned: bool) -> dict:
        return await self._read_only()


class FeedRecorder:
    """Collects what a LiveFeed receives (pass `recorder.sink` as its sink) and writes it as NDJSON."""

    def __init__(self):
        self.lines: list[str] = []

    def sink(self, source: str, data) -> None:
        self.lines.append(json.dumps({"source": source, "data": data}, separators=(",", ":")))

    def write(self, path: str | Path) -> int:
        Path(path).write_text("\n".join(self.lines) + "\n")
        return len(self.lines)


async def record(path: str | Path, socket_path: str | Path | None, seconds: float) -> int:
    """Record what the console would see for `seconds` into an NDJSON file; returns the number of lines."""
    recorder = FeedRecorder()
    task = asyncio.ensure_future(LiveFeed(ConsoleState(), socket_path, sink=recorder.sink).run())
    try:
        await asyncio.sleep(seconds)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return recorder.write(path)

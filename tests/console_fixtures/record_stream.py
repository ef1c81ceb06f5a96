"""Record the event stream fixture for the console's pilot and snapshot tests, from the real daemon.

    .venv/bin/python tests/console_fixtures/record_stream.py

Starts gpuservd on a tiny random model with a squeezed KV pool, sends a small
burst and then a large one (which preempts), and records what `gpuserv top`
sees into stream.ndjson (the format `gpuserv top --record` writes). It stops
at the first requests poll, after a preemption, that shows requests in flight,
so the requests screen has rows to show.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent))

from daemon_harness import DaemonProcess, make_home  # noqa: E402
from factories import make_model_dir  # noqa: E402

from console.feed import LiveFeed, FeedRecorder  # noqa: E402
from console.state import ConsoleState  # noqa: E402
from console_fixtures.workload import SQUEEZED, burst  # noqa: E402


async def _record(socket_path, timeout: float = 30.0) -> FeedRecorder:
    state = ConsoleState()
    recorder = FeedRecorder()
    done = asyncio.Event()

    def sink(source: str, data) -> None:
        recorder.sink(source, data)
        if source == "requests" and data and state.recent_preemptions():
            done.set()

    task = asyncio.ensure_future(LiveFeed(state, socket_path, poll_s=0.5, sink=sink).run())
    try:
        await asyncio.sleep(1.0)
        burst(socket_path, n=3, max_tokens=20)
        await asyncio.sleep(1.5)
        burst(socket_path, n=8)
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return recorder


def main(out: Path = HERE / "stream.ndjson") -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        home = make_home(tmp, make_model_dir(tmp / "model"))
        daemon = DaemonProcess(tmp, home, config=SQUEEZED)
        try:
            daemon.wait_ready()
            recorder = asyncio.run(_record(daemon.socket))
            print(f"{recorder.write(out)} lines -> {out}")
        finally:
            daemon.stop()


if __name__ == "__main__":
    main()

"""`gpuserv record`: live traffic from the daemon as a trace that `gpuserv bench -w` replays (load tests
with real workloads, not fixed lengths).

Each `request_finished` event (arrival time, model, tenant, priority, prompt
and output token counts) becomes one JSONL line of the bench's trace format:
`{"t": seconds since the recording started, "model", "prompt_tokens",
"output_tokens", "priority", "tenant"}`. Prompt text is left out unless asked
(`--with-prompts`, which subscribes to the daemon's private `request_prompt`
events; the line then carries `prompt` instead of `prompt_tokens`). Requests
that arrived before the recording started, failed (no 200) or produced no
token are skipped: their lengths would not replay what happened.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

from gpuservd.bench.workload import Workload
from gpuservd.bench.workload_schema import Arrival
from gpuservd.events.types import Event, Hello, RequestFinished, RequestPrompt, read_event


def trace_line(event: RequestFinished | dict, t0: float, prompt: str | None = None) -> dict | None:
    """One request_finished event (or its JSON) as a trace line (None when it should not be replayed)."""
    if not isinstance(event, RequestFinished):
        event = RequestFinished.from_json(event)
    if event.status != 200 or not event.num_output_tokens or not event.num_prompt_tokens:
        return None
    arrival = event.arrival_t
    if arrival is None:  # a daemon from before arrival_t: finish time minus latency
        arrival = event.t - (event.e2e_s or 0.0)
    if arrival < t0:
        return None
    line = {"t": round(arrival - t0, 4), "model": event.model}
    if prompt:
        line["prompt"] = prompt
    else:
        line["prompt_tokens"] = int(event.num_prompt_tokens)
    line.update(output_tokens=int(event.num_output_tokens), priority=int(event.priority or 0),
                tenant=event.tenant or "default")
    return line


class TraceRecorder:
    """Turns the event stream into trace lines, written (and flushed) as requests finish."""

    def __init__(self, out, t0: float, with_prompts: bool = False):
        self.out = out  # a text file
        self.t0 = t0
        self.with_prompts = with_prompts
        self.prompts: dict[str, str] = {}  # request_id -> text, until the request finishes
        self.num_written = 0
        self.num_skipped = 0
        self.models: dict[str, int] = {}  # model -> requests recorded
        self._lock = threading.Lock()

    def feed(self, event: Event | dict) -> None:
        """One event from the stream (its JSON as the client reads it, or the event itself)."""
        if not isinstance(event, Event):
            event = read_event(event)
        if isinstance(event, RequestPrompt):
            self.prompts[event.request_id] = event.prompt
        elif isinstance(event, RequestFinished):
            prompt = self.prompts.pop(event.request_id, None)
            line = trace_line(event, self.t0, prompt if self.with_prompts else None)
            with self._lock:
                if line is None:
                    self.num_skipped += 1
                    return
                self.out.write(json.dumps(line) + "\n")
                self.out.flush()
                self.num_written += 1
                self.models[line["model"]] = self.models.get(line["model"], 0) + 1


def _stop_on_signals() -> None:
    """Ctrl-C (SIGINT) and SIGTERM end a recording. Set explicitly: a process started in the
    background by a non-interactive shell inherits SIGINT ignored, and Python keeps that."""
    if threading.current_thread() is not threading.main_thread():
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def record(client, out_path: Path, seconds: float | None, with_prompts: bool = False, log=print) -> TraceRecorder:
    """Record until `seconds` pass (None: until Ctrl-C); the stream is read on a helper thread so an idle
    daemon does not hold the recording open past its time."""
    types = ["request_finished"] + (["request_prompt"] if with_prompts else [])
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with out_path.open("w") as out:
        rec = TraceRecorder(out, time.time(), with_prompts)
        failed: list[BaseException] = []
        connected = threading.Event()

        def read():
            try:
                for event in client.events(types):
                    if event.get("type") == Hello.type:
                        connected.set()
                    elif not stop.is_set():
                        rec.feed(event)
            except BaseException as exc:  # the daemon went away, or we closed the client to stop
                if not stop.is_set():
                    failed.append(exc)
            finally:
                connected.set()

        stop = threading.Event()
        _stop_on_signals()
        reader = threading.Thread(target=read, name="record", daemon=True)
        reader.start()
        connected.wait(30)
        if failed:
            raise failed[0]
        try:  # a Ctrl-C right after the "recording" line must end the recording too
            log(f"recording to {out_path}" + (f" for {seconds:g} s" if seconds else " until Ctrl-C"))
            deadline = time.monotonic() + seconds if seconds else None
            while reader.is_alive() and (deadline is None or time.monotonic() < deadline):
                reader.join(0.1 if deadline is None else min(0.1, max(0.0, deadline - time.monotonic())))
        except KeyboardInterrupt:
            pass
        stop.set()
        # Closing the client while the reader thread sits in a streaming read can block on the
        # connection pool; close it on a daemon thread so stopping never hangs (the process or the
        # caller goes on; the daemon drops the stream when the socket closes).
        threading.Thread(target=client.close, name="record-close", daemon=True).start()
        if failed:
            raise failed[0]
    return rec


def trace_workload(path: Path) -> Workload:
    """A bare trace file as a workload: its lines as recorded, the first line's model as the default."""
    try:
        first = next((json.loads(line) for line in path.read_text().splitlines() if line.strip()), {})
    except ValueError:  # _read_trace names the line and the problem
        first = {}
    model = first.get("model") if isinstance(first, dict) else None
    return Workload(name=path.stem, model=model or "smollm2", seed=0, requests=None,
                    arrival=Arrival("trace", path=path.name, trace_path=path.resolve()), classes=[], path=path)

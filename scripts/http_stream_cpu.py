#!/usr/bin/env python3
"""The event loop's CPU per streamed chunk on the daemon's real streaming path, without an engine.

The daemon's server (api/server.py's protocol, uvicorn) and the completions route's SSE rendering
(openai_routes._events, api/http.StreamResponse) serve STREAMS streams on a Unix socket; a timer on the loop
stands in for the engine thread and hands every stream one token per STEP_MS, as the engine's per-step post
does (serving/models.on_post -> RequestSink.put). The client reads the streams in a separate process, so
the only CPU counted is the server's event loop thread (time.thread_time around the steps). With no torch
beside it, this is the number to A/B a change of the streaming path by; scripts/http_step_cpu.py then checks
what it does for the engine.

    PYTHONPATH=$PWD .venv/bin/python scripts/http_stream_cpu.py [--streams 48] [--steps 200] [--step-ms 20]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import sys
import tempfile
import time
from types import SimpleNamespace

from starlette.applications import Starlette
from starlette.routing import Route

from gpuservd.api import openai_routes
from gpuservd.api.choices import Choice
from gpuservd.api.http import StreamResponse, endpoint
from gpuservd.api.protocol import GenerationRequest
from gpuservd.api.server import make_server
from gpuservd.engine.request import FinishReason, RequestOutput
from gpuservd.serving.request_stream import ActiveRequest, RequestContext


def client(path: str, streams: int, ready, token_ids: bool) -> None:
    """Open the streams, read every byte to the end (raw sockets: the client's own CPU stays out of it)."""
    body = b'{"model":"m","prompt":"x","stream":true' + (b',"return_token_ids":true' if token_ids else b"") + b"}"
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)
    socks = []
    for _ in range(streams):
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(head)
        socks.append(s)
    ready.set()
    import selectors
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ)
    left = len(socks)
    while left:
        for key, _ in sel.select():
            data = key.fileobj.recv(1 << 16)
            if not data or data.endswith(b"0\r\n\r\n"):
                sel.unregister(key.fileobj)
                key.fileobj.close()
                left -= 1


def bench_client(path: str, streams: int, ready, token_ids: bool, cpu) -> None:
    """The bench's own streaming client (gpuservd/bench: post_sse + count_chunk) on the streams; its process
    CPU goes to `cpu` (a multiprocessing.Value)."""
    import orjson

    from gpuservd.bench.http_client import StreamCount, count_chunk
    from gpuservd.bench.sse_stream import post_sse

    body = {"model": "m", "prompt": "x", "stream": True, "return_token_ids": token_ids}

    async def run():
        counts = [StreamCount() for _ in range(streams)]
        c0 = time.process_time()
        await asyncio.gather(*(post_sse("http://localhost", path, "/v1/completions", orjson.dumps(body),
                                        lambda p, c=c: count_chunk(p, c, 0.0)) for c in counts))
        cpu.value = time.process_time() - c0

    ready.set()
    asyncio.run(run())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=48)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--token-ids", action="store_true")
    p.add_argument("--bench-client", action="store_true", help="read with the bench's client and report its CPU")
    a = p.parse_args()

    sinks: list = []
    server_cfg = SimpleNamespace(header_timeout_s=30.0, body_timeout_s=30.0, max_connections_per_user=1000,
                                 backlog=256)
    slot = SimpleNamespace(num_queued=0, loop=None, tokenizer=None)

    @endpoint(prefix="cmpl")
    async def completions(request):
        await request.body()
        rid = request.scope["state"]["request_id"]
        greq = GenerationRequest(kind="completion", model="m", prompt="x", stream=True,
                                 return_token_ids=a.token_ids)
        ctx = RequestContext(rid, None, None, None, "unix")
        active = ActiveRequest(slot, ctx, greq, lambda r: None, lambda r: None)
        slot.num_queued += 1
        sinks.append(active.sink)
        choices = [Choice(0, active, greq, 0, False)]
        return StreamResponse(lambda w: openai_routes._events(choices, greq, rid, 0, w), on_close=lambda d=False: None,
                              media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    app.state.metrics = None
    app.state.tcp_token = None

    async def run(path: str) -> None:
        server = make_server(app, server_cfg)
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(path)
        serve = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        for r in range(a.rounds):
            sinks.clear()
            ready = multiprocessing.Event()
            client_cpu = multiprocessing.Value("d", 0.0)
            proc = multiprocessing.Process(target=bench_client if a.bench_client else client,
                                           args=(path, a.streams, ready, a.token_ids)
                                           + ((client_cpu,) if a.bench_client else ()))
            proc.start()
            while len(sinks) < a.streams:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            step = 0
            cpu = 0.0
            done = asyncio.Event()

            def deliver():
                nonlocal step, cpu
                c0 = time.thread_time()
                last = step == a.steps - 1
                for i, sink in enumerate(sinks):
                    sink.put(RequestOutput(f"r{i}", [1000 + step], f" tok{step}", last,
                                           FinishReason.LENGTH if last else None, 1, step + 1, 0.0, None, None))
                step += 1
                # the readers' turns: run the callbacks this delivery queued before the clock stops
                loop.call_soon(lambda: measure(c0))

            def measure(c0):
                nonlocal cpu
                cpu += time.thread_time() - c0
                if step < a.steps:
                    loop.call_later(a.step_ms / 1000, deliver)
                else:
                    done.set()

            t0 = time.thread_time()
            w0 = time.perf_counter()
            loop.call_soon(deliver)
            await done.wait()
            total = time.thread_time() - t0
            await asyncio.get_running_loop().run_in_executor(None, proc.join)
            chunks = a.streams * a.steps
            print(f"[{r}] event loop CPU {1e6 * total / chunks:6.1f} us/chunk overall, "
                  f"{1e6 * cpu / chunks:6.1f} us/chunk in the delivery turn "
                  + (f", bench client {1e6 * client_cpu.value / chunks:.1f} us/chunk" if a.bench_client else "")
                  + f" ({a.streams} streams x {a.steps} steps, {time.perf_counter() - w0:.1f} s, "
                  f"load {open('/proc/loadavg').read().split()[0]})", flush=True)
        server.should_exit = True
        await serve

    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(run(os.path.join(tmp, "s.sock")))


if __name__ == "__main__":
    sys.exit(main())

"""A stream's chunks written straight to its connection (api/server.ChunkedBody) from the engine's hand-off
(ActiveRequest.stream_to): through the daemon's real server on a Unix socket, the outputs of a client that
keeps up cost no ASGI send and no reader wake-up, the bytes are correct HTTP/1.1 chunks; a client that stops
reading gets everything in order once it reads again; an HTTP/1.0 client gets a close-delimited body through
uvicorn's send; a client leaving mid-stream aborts its request and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
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


class Harness:
    """The daemon's server and completions stream rendering over fake engine outputs (the test puts them in
    each request's sink as serving.models.on_post does); counts the body messages the ASGI send carries."""

    def __init__(self, path: str):
        self.path = path
        self.actives: list[ActiveRequest] = []
        self.closed: list[bool] = []
        self.body_sends = 0
        self.slot = SimpleNamespace(num_queued=0, loop=SimpleNamespace(abort=lambda rid: self.aborted.append(rid)),
                                    tokenizer=None)
        self.aborted: list[str] = []

        @endpoint(prefix="cmpl")
        async def completions(request):
            body = json.loads(await request.body())
            rid = request.scope["state"]["request_id"]
            greq = GenerationRequest(kind=body.get("kind", "completion"), model="m", prompt="x", stream=True,
                                     return_token_ids=True, include_usage=True)
            active = ActiveRequest(self.slot, RequestContext(rid, None, None, None, "unix"), greq,
                                   lambda r: None, lambda r: None)
            self.slot.num_queued += 1
            self.actives.append(active)
            choices = [Choice(0, active, greq, 0, False)]

            def close(disconnected=False):
                active.close(disconnected)
                self.closed.append(disconnected)

            return StreamResponse(lambda w: openai_routes._events(choices, greq, rid, 0, w), on_close=close,
                                  media_type="text/event-stream")

        app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
        app.state.metrics = None
        app.state.tcp_token = None

        async def counting(scope, receive, send):
            async def counted(message):
                if message["type"] == "http.response.body":
                    self.body_sends += 1
                await send(message)

            await app(scope, receive, counted)

        cfg = SimpleNamespace(header_timeout_s=30.0, body_timeout_s=30.0, max_connections_per_user=100, backlog=16)
        counting.state = app.state  # make_server's /metrics answer reads it
        self.server = make_server(counting, cfg)

    async def __aenter__(self):
        self.task = asyncio.ensure_future(self.server.serve(sockets=[_bound(self.path)]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc):
        self.server.should_exit = True
        await self.task

    async def open(self, version: str = "1.1", kind: str = "completion"):
        reader, writer = await asyncio.open_unix_connection(self.path)
        body = json.dumps({"kind": kind}).encode()
        writer.write(f"POST /v1/completions HTTP/{version}\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                     + body)
        n = len(self.actives)
        while len(self.actives) == n:
            await asyncio.sleep(0.005)
        head = await reader.readuntil(b"\r\n\r\n")
        return reader, writer, head, self.actives[-1]


def _bound(path):
    import socket
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    return s


def out(i: int, last: bool = False, text: str | None = None) -> RequestOutput:
    return RequestOutput("r", [100 + i], f" t{i}" if text is None else text, last,
                         FinishReason.LENGTH if last else None, 1, i + 1, 0.0, None, None)


async def read_chunked(reader) -> list[bytes]:
    """The body's chunks, checking the framing, to the terminating empty chunk."""
    chunks = []
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        assert data[-2:] == b"\r\n"
        if size == 0:
            return chunks
        chunks.append(data[:-2])


def events(body: bytes) -> list:
    assert body.endswith(b"data: [DONE]\n\n")
    parts = body.split(b"\n\n")[:-2]
    assert all(p.startswith(b"data: ") for p in parts)
    return [json.loads(p[6:]) for p in parts]


def tokens(evs: list) -> list[int]:
    return [t for e in evs for c in e["choices"] for t in c.get("token_ids", [])]


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_stream_that_keeps_up_is_written_from_the_hand_off(tmp_path):
    async def main():
        async with Harness(str(tmp_path / "s.sock")) as h:
            reader, writer, head, active = await h.open()
            assert b"transfer-encoding: chunked" in head.lower()
            await settle()
            for i in range(20):
                active.sink.put(out(i, last=i == 19))
                await settle()
            evs = events(b"".join(await read_chunked(reader)))
            assert tokens(evs) == [100 + i for i in range(20)]
            assert "".join(c["text"] for e in evs for c in e["choices"]) == "".join(f" t{i}" for i in range(20))
            assert evs[-2]["choices"][0]["finish_reason"] == "length" and evs[-1]["usage"]["completion_tokens"] == 20
            # the reader woke for the last output only; the ASGI send carried only the end of the body
            assert active.sink.num_wakeups == 1
            assert h.body_sends == 1
            assert active.sink.listener is None and h.closed == [False]
            # keep-alive: the same connection serves the next stream
            writer.write(b'POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}')
            while len(h.actives) < 2:
                await asyncio.sleep(0.005)
            await reader.readuntil(b"\r\n\r\n")
            await settle()
            h.actives[1].sink.put(out(0, last=True))
            assert tokens(events(b"".join(await read_chunked(reader)))) == [100]
            writer.close()

    asyncio.run(main())


def test_chat_opens_with_its_role_before_direct_chunks(tmp_path):
    async def main():
        async with Harness(str(tmp_path / "s.sock")) as h:
            reader, writer, _, active = await h.open(kind="chat")
            await settle()
            for i in range(3):
                active.sink.put(out(i, last=i == 2))
                await settle()
            evs = events(b"".join(await read_chunked(reader)))
            assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert [e["choices"][0]["delta"].get("content") for e in evs[1:4]] == [" t0", " t1", " t2"]
            writer.close()

    asyncio.run(main())


def test_a_client_that_stops_reading_gets_everything_in_order(tmp_path):
    async def main():
        async with Harness(str(tmp_path / "s.sock")) as h:
            reader, writer, _, active = await h.open()
            await settle()
            n = 400  # ~4 MB: well past the socket buffers and the transport's high-water mark
            for i in range(n):
                active.sink.put(out(i, last=i == n - 1, text=f"<{i}>" + "x" * 10000))
                await settle()
            evs = events(b"".join(await read_chunked(reader)))
            assert tokens(evs) == [100 + i for i in range(n)]
            text = "".join(c["text"] for e in evs for c in e["choices"])
            assert text == "".join(f"<{i}>" + "x" * 10000 for i in range(n))
            # past the high-water mark the outputs waited with the stream's reader, which sent what piled up
            # as one chunk once the client read again
            assert active.sink.num_wakeups >= 1 and len(evs) < n / 2
            writer.close()

    asyncio.run(main())


def test_http_1_0_gets_the_body_through_uvicorns_send(tmp_path):
    async def main():
        async with Harness(str(tmp_path / "s.sock")) as h:
            reader, writer, head, active = await h.open(version="1.0")
            assert b"chunked" not in head.lower()
            await settle()
            for i in range(5):
                active.sink.put(out(i, last=i == 4))
                await settle()
            evs = events(await reader.read())  # delimited by the close
            assert tokens(evs) == [100 + i for i in range(5)]
            assert h.body_sends > 5
            writer.close()

    asyncio.run(main())


def test_a_client_leaving_mid_stream_aborts_it_and_the_server_serves_on(tmp_path):
    async def main():
        async with Harness(str(tmp_path / "s.sock")) as h:
            loop = asyncio.get_running_loop()
            errors = []
            loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
            reader, writer, _, active = await h.open()
            await settle()
            for i in range(3):
                active.sink.put(out(i))
                await settle()
            writer.close()
            for _ in range(100):
                if h.closed:
                    break
                await asyncio.sleep(0.01)
            assert h.closed == [True] and h.aborted == [active.ctx.request_id]
            assert active.sink.listener is None
            for i in range(3, 10):  # the engine's outputs still in flight: nowhere to go, no error
                active.sink.put(out(i))
                await settle()
            reader2, writer2, _, active2 = await h.open()
            await settle()
            active2.sink.put(out(0, last=True))
            assert tokens(events(b"".join(await read_chunked(reader2)))) == [100]
            writer2.close()
            assert not errors

    asyncio.run(main())


def test_a_handler_that_raises_leaves_its_output_to_its_reader_and_spares_the_other_streams():
    """One hand-off carries every stream's output: one stream's rendering failing must not drop the rest."""
    slot = SimpleNamespace(num_queued=2, loop=None)
    greq = GenerationRequest(kind="completion", model="m", prompt="x", stream=True)
    a, b = (ActiveRequest(slot, RequestContext(r, None, None, None, "unix"), greq, lambda r: None, lambda r: None)
            for r in ("a", "b"))
    got = []

    def bad(o):
        raise ValueError("render failed")

    a.stream_to(bad)
    b.stream_to(lambda o: got.append(o.new_token_ids) or True)
    for i in range(3):
        for sink, item in ((a.sink, out(i)), (b.sink, out(i))):  # as serving.models.on_post delivers
            sink.put(item)
    assert got == [[100], [101], [102]] and b.num_output_tokens == 3
    assert [o.new_token_ids for o in a.sink._items] == [[100], [101], [102]]  # its reader gets them all
    assert a.sink.listener is None

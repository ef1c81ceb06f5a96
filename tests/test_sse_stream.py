"""The benchmark's lean SSE reader (gpuservd/bench/sse_stream.py) against raw servers on a Unix socket
and on TCP: every HTTP body framing, bytes split at every boundary, errors, early ends and silence."""

from __future__ import annotations

import asyncio
import json

import pytest

from gpuservd.bench.sse_stream import StreamFailed, post_sse, request_bytes

EVENTS = [b'{"choices":[{"text":"a\\nb","token_ids":[1,2]}]}', b'{"choices":[],"usage":{"completion_tokens":2}}',
          b"[DONE]"]
SSE = b"".join(b"data: " + e + b"\n\n" for e in EVENTS)


def chunked(body: bytes, sizes=(7, 1, 30, 2)) -> bytes:
    """body in chunks of the given sizes (cycled), with a chunk extension on one, then the last chunk."""
    out, at, i = b"", 0, 0
    while at < len(body):
        n = sizes[i % len(sizes)]
        ext = b";x=y" if i == 1 else b""
        out += b"%x%s\r\n%s\r\n" % (len(body[at:at + n]), ext, body[at:at + n])
        at, i = at + n, i + 1
    return out + b"0\r\n\r\n"


async def _serve(response: bytes, piece: int, tmp_path, hold_open: bool = False, seen: list | None = None):
    """A server that reads one request and writes `response` `piece` bytes at a time."""
    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")).split(b":")[1])
        body = await reader.readexactly(length)
        if seen is not None:
            seen.append((head, body))
        for at in range(0, len(response), piece):
            writer.write(response[at:at + piece])
            await writer.drain()
            await asyncio.sleep(0)
        if hold_open:
            await asyncio.sleep(30)
        writer.close()

    path = str(tmp_path / "s.sock")
    return await asyncio.start_unix_server(handle, path), path


def _run(response: bytes, piece: int, tmp_path, **kw):
    got: list[bytes] = []
    seen: list = []

    async def main():
        server, path = await _serve(response, piece, tmp_path, kw.pop("hold_open", False), seen)
        async with server:
            await post_sse("http://gpuserv/base", path, "/v1/completions", b'{"x":1}', got.append, **kw)

    asyncio.run(main())
    return got, seen


HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 13, 4096])
def test_chunked_body_split_anywhere_gives_every_event(tmp_path, piece):
    got, seen = _run(HEAD_CHUNKED + chunked(SSE), piece, tmp_path)
    assert got == EVENTS
    head, body = seen[0]
    assert head.startswith(b"POST /base/v1/completions HTTP/1.1\r\n") and b"Host: gpuserv\r\n" in head
    assert body == b'{"x":1}'


@pytest.mark.parametrize("piece", [1, 9, 4096])
def test_content_length_and_connection_close_bodies(tmp_path, piece):
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(SSE)
    assert _run(head + SSE, piece, tmp_path)[0] == EVENTS
    # HTTP/1.0: the body ends with the connection; a last line without its newline still counts.
    assert _run(b"HTTP/1.0 200 OK\r\n\r\n" + SSE + b"data: {\"last\":1}", piece, tmp_path)[0] == EVENTS + [b'{"last":1}']


def test_lines_that_are_not_data_are_skipped(tmp_path):
    body = b": keep-alive\n\nevent: x\ndata:{\"a\":1}\r\n\n" + SSE
    assert _run(HEAD_CHUNKED + chunked(body), 4096, tmp_path)[0] == [b'{"a":1}'] + EVENTS


def test_an_error_status_raises_with_the_body(tmp_path):
    err = json.dumps({"error": {"message": "model nope not found"}}).encode()
    with pytest.raises(StreamFailed, match="HTTP 404: .*model nope not found"):
        _run(b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n" % len(err) + err, 5, tmp_path)
    with pytest.raises(StreamFailed, match="HTTP 500"):
        _run(b"HTTP/1.1 500 Internal Server Error\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(err), 4096, tmp_path)


@pytest.mark.parametrize("response", [HEAD_CHUNKED + chunked(SSE)[:-5],  # no last chunk
                                      b"HTTP/1.1 200 OK\r\nContent-Length: 999\r\n\r\n" + SSE,  # short body
                                      b"HTTP/1.1 200 OK\r\nContent-"])  # the head cut off
def test_a_connection_that_ends_early_fails(tmp_path, response):
    with pytest.raises(StreamFailed, match="connection closed before the response ended"):
        _run(response, 4096, tmp_path)


@pytest.mark.parametrize("response, why", [(b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP response"),
                                           (HEAD_CHUNKED + b"zz\r\n", "bad chunk size line b'zz'")])
def test_a_malformed_response_fails(tmp_path, response, why):
    with pytest.raises(StreamFailed, match=why):
        _run(response, 4096, tmp_path)


def test_a_silent_server_times_out(tmp_path):
    with pytest.raises(StreamFailed, match="no data for"):
        _run(HEAD_CHUNKED + chunked(SSE)[:20], 4096, tmp_path, hold_open=True, read_timeout_s=0.3)


def test_tcp_and_a_refused_connection():
    got: list[bytes] = []

    async def main():
        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(HEAD_CHUNKED + chunked(SSE))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            await post_sse(f"http://127.0.0.1:{port}", None, "/v1/completions", b"{}", got.append)
        with pytest.raises(OSError):  # nobody listens there any more
            await post_sse(f"http://127.0.0.1:{port}", None, "/v1/completions", b"{}", got.append)

    asyncio.run(main())
    assert got == EVENTS


def test_request_bytes():
    raw = request_bytes("http://127.0.0.1:8080", "/v1/completions", b"{}")
    assert raw.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n")
    assert raw.endswith(b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")


def test_a_cancelled_stream_closes_its_connection(tmp_path):
    """A replay that is interrupted must not leave the server streaming to nobody: it sees the EOF."""
    got: list[bytes] = []

    async def main():
        eof = asyncio.Event()

        async def handle(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(HEAD_CHUNKED + chunked(b'data: {"a":1}\n\n')[:-5])  # one event, and the stream goes on
            await writer.drain()
            await reader.read()  # returns at EOF: the client hung up
            eof.set()
            writer.close()

        path = str(tmp_path / "c.sock")
        server = await asyncio.start_unix_server(handle, path)
        async with server:
            task = asyncio.ensure_future(post_sse("http://x", path, "/v1/completions", b"{}", got.append))
            while not got:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(eof.wait(), 10)

    asyncio.run(main())
    assert got == [b'{"a":1}']

"""One streaming HTTP/1.1 POST, read as server-sent events, with as little CPU per event as possible.

The benchmark client runs on the same cores as the server it measures, and at 48 streams it reads
one event per stream per engine step: every microsecond it spends per event is taken from the
server. httpx reads a stream through several layers (h11's event parser, anyio's stream, httpx's
byte, text and line decoders, an async generator per line), about 0.2 ms of CPU per event on a
2-core machine; this reads the socket with an asyncio Protocol, undoes the chunked transfer
encoding and splits the SSE lines in place, several times cheaper.

What it speaks: one request per connection (`Connection: close`), a response body framed by
`Transfer-Encoding: chunked`, `Content-Length`, or the connection's end (HTTP/1.0), over TCP
or a Unix socket. Every `data:` line's payload (bytes, without the prefix) goes to `on_data`.
A status other than 200 raises `StreamFailed` with the start of the body; so do a malformed
response, a connection that ends before the body does, and `read_timeout_s` without a byte.
"""

from __future__ import annotations

import asyncio
from typing import Callable
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024  # a response head larger than this is not an HTTP server we can measure


class StreamFailed(Exception):
    """The server answered with an error status, broke the HTTP framing, went quiet or hung up early."""


def request_bytes(base_url: str, path: str, body: bytes) -> bytes:
    """The POST request: base_url's path prefix + path, its host as Host, JSON body."""
    url = urlsplit(base_url)
    target = url.path.rstrip("/") + path
    return (f"POST {target} HTTP/1.1\r\nHost: {url.netloc or 'localhost'}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode("latin-1") + body


class _SSEProtocol(asyncio.Protocol):
    """Parses one response as it arrives: head, then body framing, then SSE lines."""

    def __init__(self, on_data: Callable[[bytes], None], done: asyncio.Future, read_timeout_s: float):
        self.on_data = on_data
        self.done = done
        self.read_timeout_s = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.buf = b""  # bytes not yet parsed (head, a chunk header, a partial line)
        self.status = 0
        self.mode = ""  # "" while reading the head, then "chunked" | "length" | "close"
        self.left = 0  # length mode: body bytes still to come; chunked: bytes of the current chunk
        self.error_body = b""  # the start of a non-200 response's body, for the message
        self.lines = b""  # SSE bytes not yet ended by a newline
        self.last = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # ---- asyncio callbacks ---------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        loop = asyncio.get_running_loop()
        self.last = loop.time()
        self.timer = loop.call_later(self.read_timeout_s, self._check_quiet)

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        self.last = asyncio.get_running_loop().time()
        try:
            self._feed(data)
        except Exception as exc:  # a malformed response or on_data refusing a payload: this stream fails
            self._finish(exc)

    def eof_received(self):
        return False  # close the transport; connection_lost decides whether the body was complete

    def connection_lost(self, exc) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.done.done():
            return
        if self.mode == "close":  # the body ends with the connection (HTTP/1.0)
            self._flush_lines()
            self._finish(None)
        else:
            self._finish(StreamFailed(f"connection closed before the response ended ({exc or 'EOF'})"))

    def _check_quiet(self) -> None:
        loop = asyncio.get_running_loop()
        quiet = loop.time() - self.last
        if quiet >= self.read_timeout_s:
            self._finish(StreamFailed(f"no data for {self.read_timeout_s:.0f} s"))
        elif not self.done.done():
            self.timer = loop.call_later(self.read_timeout_s - quiet, self._check_quiet)

    # ---- parsing -------------------------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        if not self.mode:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buf) > MAX_HEAD:
                    raise StreamFailed("response head too large")
                return
            head, data = self.buf[:end], self.buf[end + 4:]
            self.buf = b""
            self._head(head)
        if self.mode == "chunked":
            self._chunked(data)
        elif self.mode == "length":
            data = data[:self.left]
            self.left -= len(data)
            self._body(data)
            if self.left == 0:
                self._flush_lines()
                self._finish(None)
        else:
            self._body(data)

    def _head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise StreamFailed(f"not an HTTP response: {lines[0][:80]!r}")
        self.status = int(parts[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            self.mode = "chunked"
        elif b"content-length" in headers:
            self.mode = "length"
            self.left = int(headers[b"content-length"])
        else:
            self.mode = "close"

    def _chunked(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        self.buf = b""
        at, n = 0, len(buf)
        while at < n:
            if self.left > 0:  # inside a chunk's data
                take = min(self.left, n - at)
                self._body(buf[at:at + take])
                self.left -= take
                at += take
                if self.left:
                    return
                self.left = -2  # the CRLF after the data
            if self.left < 0:  # skip the CRLF that ends a chunk's data
                skip = min(-self.left, n - at)
                at += skip
                self.left += skip
                continue
            eol = buf.find(b"\r\n", at)
            if eol < 0:
                self.buf = buf[at:]
                return
            try:
                size = int(buf[at:eol].split(b";", 1)[0], 16)
            except ValueError:
                raise StreamFailed(f"bad chunk size line {buf[at:eol][:40]!r}") from None
            at = eol + 2
            if size == 0:  # the last chunk (trailers, if any, are not read)
                self._flush_lines()
                self._finish(None)
                return
            self.left = size

    def _body(self, data: bytes) -> None:
        if self.status != 200:
            if len(self.error_body) < 300:
                self.error_body += data[:300]
            return
        if not data:
            return
        if self.lines:
            data = self.lines + data
        end = data.rfind(b"\n")
        if end < 0:
            self.lines = data
            return
        self.lines = data[end + 1:]
        for line in data[:end].split(b"\n"):
            if line.startswith(b"data:"):
                self.on_data(line[5:].strip())

    def _flush_lines(self) -> None:
        """The body ended: a last line without its newline still counts."""
        if self.lines and self.status == 200:
            line, self.lines = self.lines, b""
            if line.startswith(b"data:"):
                self.on_data(line[5:].strip())

    def _finish(self, exc: BaseException | None) -> None:
        if self.done.done():
            return
        if exc is None and self.status != 200:
            exc = StreamFailed(f"HTTP {self.status}: {self.error_body[:300]!r}")
        if exc is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


async def post_sse(base_url: str, uds: str | None, path: str, body: bytes, on_data: Callable[[bytes], None],
                   connect_timeout_s: float = 60.0, read_timeout_s: float = 900.0) -> None:
    """POST `body` (JSON) to base_url + path and hand every SSE `data:` payload to on_data, until the
    response ends; over the Unix socket `uds` when given, else TCP to base_url's host and port."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def factory():
        return _SSEProtocol(on_data, done, read_timeout_s)

    if uds:
        connect = loop.create_unix_connection(factory, uds)
    else:
        url = urlsplit(base_url)
        connect = loop.create_connection(factory, url.hostname or "127.0.0.1", url.port or 80)
    try:
        transport, _ = await asyncio.wait_for(connect, connect_timeout_s)
    except asyncio.TimeoutError:
        raise StreamFailed(f"could not connect within {connect_timeout_s:.0f} s") from None
    try:
        transport.write(request_bytes(base_url, path, body))
        await done
    finally:
        transport.close()

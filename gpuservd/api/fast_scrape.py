"""GET /metrics answered straight from the connection's protocol, without the ASGI stack.

A scrape through uvicorn's h11 protocol and Starlette costs the event loop about 0.4 ms of CPU (h11's
parsing and event checks, a task, the middleware, the route, three transport writes) and several trips
through the loop, each of which lets the engine threads take the GIL: while the engines run Python
between their tensor ops, the scrape then waits for it again at every trip. Here a request that is
plainly `GET /metrics HTTP/1.1` with nothing to negotiate is parsed in one pass inside `data_received`
and answered with one write of the (usually rendered-ahead: api/scrape_cache.py) body, in the same
callback that read it.

Anything else takes the ordinary path, which gives the same answer or the right error: another method,
path or query, HTTP/1.0, a request split over several reads or pipelined behind another, a body or
`Expect`, `Connection` other than keep-alive, a malformed or unusual header, a bad X-Request-Id, and
a TCP scrape without a valid token when server.metrics_public is off (its 401 is counted like any other).
So the fast path answers exactly what the route in admin_routes.py answers, just sooner.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass

import h11

from gpuservd.api.http import tcp_token_ok
from gpuservd.api.metrics import CONTENT_TYPE

REQUEST_LINE = b"GET /metrics HTTP/1.1\r\n"
END = b"\r\n\r\n"
MAX_HEAD = 8192  # a longer head is unusual for a scrape: the ordinary path reads it
_NAME = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token (RFC 9110), as h11 checks it
_VALUE = re.compile(rb"[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*|")  # h11's field-value
_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")  # api/http.py's rule for X-Request-Id
# headers that change how the request is read or answered: left to the ordinary path
_OTHER_PATH = {b"content-length", b"transfer-encoding", b"expect", b"upgrade", b"te", b"trailer"}


def scrape_head(data: bytes) -> dict[bytes, bytes] | None:
    """The headers (lower-case names, first of each) of `data` when it is exactly one complete head of
    a plain `GET /metrics HTTP/1.1` with no body; None for anything the ordinary path must read."""
    if not data.startswith(REQUEST_LINE) or len(data) > MAX_HEAD or data.find(END) != len(data) - 4:
        return None
    headers: dict[bytes, bytes] = {}
    for line in data[len(REQUEST_LINE):-4].split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if not colon or not _NAME.fullmatch(name):  # also an obs-fold line (leading space) or a bare \n
            return None
        value = value.strip(b" \t")
        if not _VALUE.fullmatch(value):
            return None
        name = name.lower()
        if name in _OTHER_PATH:
            return None
        headers.setdefault(name, value)
    if b"host" not in headers:
        return None  # h11 answers 400
    if headers.get(b"connection", b"keep-alive").lower() != b"keep-alive":
        return None  # close, upgrade, ...: the ordinary path honours it
    return headers


@dataclass
class ScrapeSource:
    """What a scrape reads: the app's state (serving: the live config, scrape_cache, tcp_token, admin_token)."""

    state: object
    hits: int = 0  # scrapes answered here (tests read it)

    def allowed(self, headers: dict[bytes, bytes], via: str) -> bool:
        """The route's rule: open on the Unix socket, over TCP with server.metrics_public or a token."""
        s = self.state
        return s.serving.config.server.metrics_public or tcp_token_ok(
            via, headers.get(b"authorization", b"").decode("latin-1"), s.tcp_token, s.admin_token)

    def response(self, request_id: bytes, default_headers) -> bytes:
        """The whole response: status line, headers (uvicorn's defaults first, as the ordinary path), body."""
        body, timing = scrape(self.state)
        head = [b"HTTP/1.1 200 OK\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in default_headers]
        head.append(b"content-type: %s\r\ncontent-length: %d\r\nserver-timing: %s\r\nx-request-id: %s\r\n\r\n"
                    % (CONTENT_TYPE_HEADER, len(body), timing.encode(), request_id))
        self.hits += 1
        return b"".join(head) + body


# Starlette adds the charset to a text/ media type that lacks one; the same header on both paths
CONTENT_TYPE_HEADER = (CONTENT_TYPE if "charset=" in CONTENT_TYPE.lower() else CONTENT_TYPE + "; charset=utf-8").encode()


def scrape(state) -> tuple[bytes, str]:
    """(body, Server-Timing): the render's wall and CPU time on the event loop's thread, so that a scraper
    can tell a slow render from a slow wake-up or a wait for the GIL around it (a wall above the CPU: the
    thread lost its core or the GIL mid-render); `age`: the body was rendered ahead that long ago
    (api/scrape_cache.py), the render then taking no time of the scrape's."""
    cache = state.scrape_cache
    cache.max_age_s = state.serving.config.server.metrics_max_age_ms / 1e3  # read live: a reload applies
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    body, age = cache.scrape()
    wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
    timing = f"render;dur={wall * 1e3:.3f}, render-cpu;dur={cpu * 1e3:.3f}"
    if age is not None:
        timing += f", age;dur={age * 1e3:.3f}"
    return body, timing


class FastScrape:
    """Mixin for the server's protocol (api/server.py PeerCredProtocol), before api/read_deadline.py's
    ReadDeadlines (whose `request_done` stops the head's clock) and uvicorn's H11Protocol: `scrapes` is the
    app's ScrapeSource (None: every request takes the ordinary path)."""

    scrapes: ScrapeSource | None = None

    def data_received(self, data: bytes) -> None:
        if self.scrapes is not None and self._between_requests():
            headers = scrape_head(data)
            if headers is not None and self._answer(headers):
                return
        super().data_received(data)

    def _between_requests(self) -> bool:
        """Nothing of an earlier request is pending: h11 is idle with nothing buffered, no cycle runs, and the
        client reads what it is sent (one that does not is left to the ordinary path, which waits for it)."""
        conn, cycle = self.conn, self.cycle
        return (conn.our_state is h11.IDLE and conn.their_state is h11.IDLE and not conn.trailing_data[0]
                and (cycle is None or cycle.response_complete) and not self.flow.write_paused
                and not self.transport.is_closing())

    def _answer(self, headers: dict[bytes, bytes]) -> bool:
        given = headers.get(b"x-request-id")
        if given is not None and not _REQUEST_ID.fullmatch(given):
            return False  # the ordinary path's 400 names the header
        if not self.scrapes.allowed(headers, self.app_state.get("via", "unix")):
            return False  # its 401, counted in gpuserv_http_errors
        self._unset_keepalive_if_required()
        request_id = given or f"req-{uuid.uuid4().hex[:24]}".encode()
        self.transport.write(self.scrapes.response(request_id, self.server_state.default_headers))
        self.server_state.total_requests += 1
        self.request_done()
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        return True

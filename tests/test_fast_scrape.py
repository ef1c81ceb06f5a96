"""GET /metrics answered by the connection's protocol (api/fast_scrape.py): the daemon's real HTTP server in
this process, on a Unix socket and a TCP port, driven with raw requests.

A plain scrape is answered without the ASGI stack (the server's `scrapes.hits` counts it) with what the
route answers; every request the fast path must not answer (other shapes, bad ids, a TCP scrape without
its token) gets the ordinary path's answer; keep-alive connections go on across both paths."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuservd.api.fast_scrape import scrape_head
from inprocess_app import Controller
from test_backend_contract import CONFIG, home  # noqa: F401  (the fixture)

TOKEN, ADMIN = "scrape-token", "scrape-admin"
GET = b"GET /metrics HTTP/1.1\r\nHost: gpuserv\r\n\r\n"


class Conn:
    """One keep-alive HTTP/1.1 connection; responses read by their Content-Length."""

    def __init__(self, address):
        family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET
        self.sock = socket.socket(family)
        self.sock.settimeout(10)
        self.sock.connect(address)
        self.buf = b""

    def send(self, raw: bytes) -> None:
        self.sock.sendall(raw)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        while b"\r\n\r\n" not in self.buf:
            self._read()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", 0))
        while len(self.buf) < length:
            self._read()
        body, self.buf = self.buf[:length], self.buf[length:]
        return int(lines[0].split()[1]), headers, body

    def get(self, raw: bytes = GET):
        self.send(raw)
        return self.response()

    def closed(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except OSError:
            return True

    def _read(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("closed")
        self.buf += chunk

    def close(self) -> None:
        self.sock.close()


def serve(tmp_path, check, server: dict | None = None) -> None:
    """The daemon's app and server (no model loaded) on a Unix socket and a TCP port with a token; runs
    check(server, unix_path, tcp_address, serving) on a thread while the server runs."""
    from gpuservd.api.metrics import Metrics
    from gpuservd.api.server import build_app, make_server
    from gpuservd.serving.daemon_config import daemon_config_from_dict
    from gpuservd.serving.serving import Serving
    from gpuservd.serving.tenants import TenantMap

    async def main():
        cfg = daemon_config_from_dict({**CONFIG, "server": {**CONFIG["server"], **(server or {})}})
        metrics = Metrics()
        serving = Serving(cfg, TenantMap(), metrics)
        metrics.serving = serving
        serving.state = "serving"
        srv = make_server(build_app(serving, metrics, Controller(), TOKEN, ADMIN), cfg.server)
        unix = socket.socket(socket.AF_UNIX)
        unix.bind(str(tmp_path / "gs.sock"))
        tcp = socket.socket(socket.AF_INET)
        tcp.bind(("127.0.0.1", 0))
        for s in (unix, tcp):
            s.listen(16)
            s.setblocking(False)
        task = asyncio.ensure_future(srv.serve(sockets=[unix, tcp]))
        while not srv.started:
            await asyncio.sleep(0.01)
        try:
            await asyncio.to_thread(check, srv, str(tmp_path / "gs.sock"), tcp.getsockname(), serving)
        finally:
            srv.should_exit = True
            await task
            await serving.stop_engines()

    asyncio.run(main())


def test_a_plain_scrape_is_answered_by_the_fast_path_with_what_the_route_answers(home, tmp_path):
    def check(srv, unix, tcp, serving):
        c = Conn(unix)
        status, fast, body = c.get()
        assert status == 200 and srv.scrapes.hits == 1
        status, slow, slow_body = c.get(b"GET /metrics?from=route HTTP/1.1\r\nHost: gpuserv\r\n\r\n")
        assert status == 200 and srv.scrapes.hits == 1  # the route served it
        assert set(fast) == set(slow) and fast["content-type"] == slow["content-type"]
        assert fast["server"] == slow["server"] and fast["x-request-id"].startswith("req-")
        assert {i.split(";")[0].strip() for i in fast["server-timing"].split(",")} >= {"render", "render-cpu"}
        fams = {f.name: f.type for f in text_string_to_metric_families(body.decode())}
        assert fams == {f.name: f.type for f in text_string_to_metric_families(slow_body.decode())}
        assert fams["vllm:num_requests_waiting"] == "gauge"
        c.close()

    serve(tmp_path, check)


def test_keep_alive_goes_on_across_both_paths_and_past_the_head_deadline(home, tmp_path):
    """A fast answer stops the read deadline's clock for the head it answered (else the connection would be
    closed header_timeout_s after it opened) and leaves h11 ready for the next request."""
    def check(srv, unix, tcp, serving):
        c = Conn(unix)
        assert c.get()[0] == 200
        time.sleep(0.6)  # past header_timeout_s of the connection's first head
        assert c.get(b"GET /health HTTP/1.1\r\nHost: gpuserv\r\n\r\n")[0] == 200
        status, headers, _ = c.get(b"GET /metrics HTTP/1.1\r\nHost: gpuserv\r\nX-Request-Id: scrape-7\r\n\r\n")
        assert status == 200 and headers["x-request-id"] == "scrape-7"
        time.sleep(0.6)
        assert c.get()[0] == 200 and srv.scrapes.hits == 3
        c.close()

    serve(tmp_path, check, {"header_timeout_s": 0.4})


# requests the fast path leaves to the route (or h11), and the status the ordinary path answers them with
LEFT = [
    (b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n", 200),
    (b"GET /metrics HTTP/1.0\r\nHost: a\r\n\r\n", 200),
    (b"GET /metrics HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n", 200),
    (b"GET /metrics HTTP/1.1\r\nHost: a\r\nX-Request-Id: has space\r\n\r\n", 400),
    (b"GET /metrics HTTP/1.1\r\n\r\n", 400),  # no Host: h11's 400
    (b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n", 200),
]


def test_what_the_fast_path_leaves_gets_the_ordinary_answer(home, tmp_path):
    def check(srv, unix, tcp, serving):
        for raw, status in LEFT:
            c = Conn(unix)
            assert c.get(raw)[0] == status and srv.scrapes.hits == 0, raw
            c.close()

    serve(tmp_path, check)


def test_split_and_pipelined_requests_take_the_ordinary_path(home, tmp_path):
    def check(srv, unix, tcp, serving):
        c = Conn(unix)
        c.send(GET[:20])
        time.sleep(0.05)  # the daemon reads the first part alone
        c.send(GET[20:])
        assert c.response()[0] == 200 and srv.scrapes.hits == 0
        c.send(GET + GET)  # two requests in one read
        assert c.response()[0] == 200 and c.response()[0] == 200 and srv.scrapes.hits == 0
        assert c.get()[0] == 200 and srv.scrapes.hits == 1  # and the connection is back on the fast path
        c.close()

    serve(tmp_path, check)


def test_a_connection_close_scrape_closes_the_connection(home, tmp_path):
    def check(srv, unix, tcp, serving):
        c = Conn(unix)
        assert c.get(b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")[0] == 200
        assert c.closed()
        c = Conn(unix)
        assert c.get(b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: Keep-Alive\r\n\r\n")[0] == 200
        assert srv.scrapes.hits == 1 and not c.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        c.close()

    serve(tmp_path, check)


def test_tcp_scrapes_need_the_token_unless_metrics_are_public(home, tmp_path):
    def check(srv, unix, tcp, serving):
        c = Conn(tcp)
        status, _, body = c.get()
        assert status == 401 and b"bearer token" in body and srv.scrapes.hits == 0  # the route's 401
        c = Conn(tcp)  # (a 401 closes its connection)
        for token in (TOKEN, ADMIN):
            raw = f"GET /metrics HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
            assert c.get(raw)[0] == 200
        assert srv.scrapes.hits == 2
        serving.config.server.metrics_public = True  # what a reload does
        assert c.get()[0] == 200 and srv.scrapes.hits == 3
        c.close()
        status, _, body = Conn(unix).get(b"GET /metrics?x=1 HTTP/1.1\r\nHost: a\r\n\r\n")
        errors = {(s.labels.get("status"), s.value) for f in text_string_to_metric_families(body.decode())
                  if f.name == "gpuserv_http_errors" for s in f.samples}
        assert ("401", 1.0) in errors  # the refused scrape counted as the route counts it

    serve(tmp_path, check)


def test_heads_the_fast_path_reads():
    assert scrape_head(GET) == {b"host": b"gpuserv"}
    h = scrape_head(b"GET /metrics HTTP/1.1\r\nHost: a\r\nAccept: text/plain;version=0.0.4;q=1,*/*;q=0.1\r\n"
                    b"User-Agent: Prometheus/3.0\r\nX-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n")
    assert h[b"accept"].startswith(b"text/plain") and h[b"user-agent"] == b"Prometheus/3.0"
    for bad in (GET + b"x",  # something after the head
                GET.replace(b"\r\n\r\n", b"\r\n X: folded\r\n\r\n"),
                GET.replace(b"Host", b"Ho st"),
                GET.replace(b"gpuserv", b"gpu\x00serv"),
                b"POST /metrics HTTP/1.1\r\nHost: a\r\n\r\n",
                b"GET /metrics HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
                b"GET /metrics HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
                b"GET /metrics HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n"):
        assert scrape_head(bad) is None, bad

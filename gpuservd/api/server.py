"""The ASGI app (Starlette) and its server (uvicorn) on a Unix socket, optionally TCP.

Listening sockets are made by the daemon (so it controls the socket file's
mode and group, and can take them from systemd socket activation) and handed
to uvicorn. uvicorn's own signal handling is switched off: SIGTERM means
*drain* here, which the daemon implements.

Peer identity: uvicorn does not put the transport in the ASGI scope, so
`PeerCredProtocol` (uvicorn's h11 protocol) reads SO_PEERCRED once per
connection and puts (pid, uid, gid) in the scope's `state`, where every
request of that connection sees it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from gpuservd.api import admin_routes, openai_routes
from gpuservd.api.auth import AdminGuard
from gpuservd.api.fast_scrape import FastScrape, ScrapeSource
from gpuservd.api.limits import BodyLimit
from gpuservd.api.peer_limit import PeerConnections, peer_key
from gpuservd.api.read_deadline import ReadDeadlines
from gpuservd.api.scrape_cache import ScrapeCache
from gpuservd.api.http import not_found

log = logging.getLogger("gpuservd.api")

_CRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


def peer_credentials(sock) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of a Unix-socket peer, None for other sockets."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError:
        return None


class PeerCredProtocol(FastScrape, ReadDeadlines, H11Protocol):
    """uvicorn's h11 protocol plus the peer's credentials in scope["state"], with read deadlines, a
    limit on the connections one peer holds (`peers`, shared by a server's connections; None = none)
    and plain GET /metrics answered without the ASGI stack (`scrapes`: api/fast_scrape.py)."""

    peers: PeerConnections | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        unix = sock is not None and sock.family == socket.AF_UNIX
        peer = peer_credentials(sock) if unix else None
        self.app_state = {**self.app_state, "peer": peer, "via": "unix" if unix else "tcp", "body_writer": self.body_writer}
        self.peer_key = None
        if self.peers is not None:
            key = peer_key(peer)
            if not self.peers.admit(key):
                transport.write(self.peers.refusal(key))
                transport.close()
                return
            self.peer_key = key

    def body_writer(self, scope) -> "ChunkedBody | None":
        """A writer of the current response's body straight to the transport (api/http.StreamResponse), or
        None where h11 does not frame it in chunks: an HTTP/1.0 client gets a body delimited by the close."""
        if self.cycle is None or self.cycle.response_complete:
            return None
        if scope.get("http_version") != "1.1" or scope.get("method") == "HEAD":
            return None
        return ChunkedBody(self.transport, self.flow)

    def connection_lost(self, exc) -> None:
        if self.peers is not None:
            self.peers.release(self.peer_key)
            self.peer_key = None
        super().connection_lost(exc)


class ChunkedBody:
    """One streamed response's body chunks written to its connection's transport as HTTP/1.1 chunks.

    A stream's chunk went through Starlette's middlewares' send wrappers, uvicorn's send and h11's
    state machine before its one transport.write; at 48 streams that is every stream's every token.
    The head and the last (empty) chunk still go through uvicorn's send, so h11 frames the head, ends
    the message and keeps its connection state (keep-alive) as for any response; h11 keeps no count of a
    chunked body's bytes, so the chunks written around it leave it consistent. Only a response h11 frames
    in chunks gets one (see PeerCredProtocol.body_writer)."""

    __slots__ = ("_transport", "_flow")

    def __init__(self, transport, flow):
        self._transport = transport
        self._flow = flow

    def write(self, data: bytes) -> None:
        """One chunk (empty data is nothing: an empty chunk would end the body). Nothing once the
        connection is closing: the client left, and the response's disconnect watcher ends the stream."""
        if data and not self._transport.is_closing():
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    @property
    def ready(self) -> bool:
        """A chunk written now goes out without waiting: the client keeps up and is still there."""
        return not self._flow.write_paused and not self._transport.is_closing()

    async def drain(self) -> None:
        """Wait while the transport's buffer is over its high-water mark (a client reading slowly)."""
        if self._flow.write_paused and not self._transport.is_closing():
            await self._flow.drain()


def build_app(serving, metrics, controller, tcp_token: str | None = None, admin_token: str | None = None) -> Starlette:
    """tcp_token: what TCP clients must send for /v1 (None = nothing); admin_token: what a TCP client
    must send for /admin (None = no admin over TCP). See api/auth.py for the roles."""
    app = Starlette(
        routes=openai_routes.routes(serving) + admin_routes.routes(serving, controller),
        exception_handlers={HTTPException: not_found},
    )
    app.state.serving = serving
    app.state.metrics = metrics
    # its max age is read from the config at each scrape (a reload applies)
    app.state.scrape_cache = ScrapeCache(lambda: metrics.render(), lambda: metrics.epoch, 0.0)
    if metrics is not None:  # (some tests build the app without metrics)
        metrics.on_epoch = app.state.scrape_cache.stale
    app.state.tcp_token = tcp_token
    app.state.admin_token = admin_token
    app.add_middleware(BodyLimit, state=app.state)
    app.add_middleware(AdminGuard, state=app.state)  # added last: runs first, before any body is read
    return app


class Server(uvicorn.Server):
    """uvicorn without its signal handlers (the daemon owns SIGTERM/SIGINT/SIGHUP)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def make_server(app, server_cfg) -> Server:
    """server_cfg: daemon_config.ServerConfig (backlog, read deadlines, connections per peer); app: build_app's
    (its state serves the fast scrapes). The server's `scrapes` counts them."""

    class Protocol(PeerCredProtocol):
        header_timeout_s = server_cfg.header_timeout_s
        body_timeout_s = server_cfg.body_timeout_s
        peers = PeerConnections(lambda: server_cfg.max_connections_per_user)  # read live: a reload applies
        scrapes = ScrapeSource(app.state)

    config = uvicorn.Config(
        app,
        http=Protocol,
        lifespan="off",
        log_config=None,  # the daemon configures logging
        access_log=False,  # we log each request ourselves, with its peer uid and tenant
        backlog=server_cfg.backlog,
        h11_max_incomplete_event_size=64 * 1024,  # a request head larger than this is a 400
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
        ws="none",
    )
    server = Server(config)
    server.scrapes = Protocol.scrapes
    return server

"""HTTP plumbing shared by the routes: request ids, errors, auth, peer identity, streaming.

`endpoint` wraps every route: it gives the request an id (the client's
X-Request-Id when it sent one, so a router's or gateway's id follows the request
through the logs, events and the response; else a new one), checks the TCP
bearer token, and turns
an APIError into its OpenAI-shaped body and anything unexpected into a 500
that names the request id, whose traceback is logged under the same id. The
daemon keeps serving either way.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import re
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from gpuservd.api import protocol
from gpuservd.api.errors import to_api_error
from gpuservd.api.protocol import APIError
from gpuservd.errors import ServingError
from gpuservd.serving.request_stream import RequestContext
from gpuservd.serving.tenants import TenantError

log = logging.getLogger("gpuservd.api")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII without spaces: safe in a log line and a header


def error_response(exc: APIError, request_id: str, metrics=None) -> JSONResponse:
    if metrics is not None:
        metrics.http_error(exc.status)
    headers = {protocol.REQUEST_ID_HEADER: request_id, **exc.headers}
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
        headers["Connection"] = "close"  # whatever body follows is never read
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def peer(request: Request) -> tuple[str, int | None, int | None]:
    """(via, uid, pid): via is "unix" or "tcp"; uid/pid come from SO_PEERCRED (see server.PeerCredProtocol)."""
    state = request.scope.get("state") or {}
    cred = state.get("peer")
    return state.get("via", "unix"), (cred[1] if cred else None), (cred[0] if cred else None)


def tcp_token_ok(via: str, authorization: str, tcp_token: str | None, admin_token: str | None) -> bool:
    """The TCP token rule: open on the Unix socket (and over TCP when no token is set); otherwise
    `Authorization: Bearer <token>` with the TCP token or the admin token. Also read by the protocol-level
    /metrics answer (api/fast_scrape.py), so both paths apply one rule."""
    if via != "tcp" or tcp_token is None:
        return True
    scheme, _, given = authorization.partition(" ")
    given = given.strip().encode()
    return scheme.lower() == "bearer" and any(
        t is not None and hmac.compare_digest(given, t.encode()) for t in (tcp_token, admin_token))


def _check_auth(request: Request) -> None:
    state = request.app.state
    via, _, _ = peer(request)
    if not tcp_token_ok(via, request.headers.get("authorization", ""), state.tcp_token,
                        getattr(state, "admin_token", None)):
        raise APIError(401, "missing or wrong bearer token (TCP clients must send Authorization: Bearer <token>)",
                       "invalid_request_error", None, "invalid_api_key")


class BodyTooLarge(Exception):
    """Raised from receive() (api/limits.py) when a body passes server.max_body_bytes mid-stream."""


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (server.max_body_bytes)",
                    "invalid_request_error", None, "request_too_large", {"Connection": "close"})


def _request_id(request: Request, prefix: str) -> tuple[str, APIError | None]:
    """The client's X-Request-Id when it is usable, else a new id (and the error to answer with)."""
    given = request.headers.get(protocol.REQUEST_ID_HEADER)
    new = f"{prefix}-{uuid.uuid4().hex[:24]}"
    if given is None:
        return new, None
    if not _REQUEST_ID.fullmatch(given):
        return new, protocol.bad_request("X-Request-Id must be 1 to 128 printable ASCII characters without spaces",
                                         "X-Request-Id", "invalid_request_id")
    return given, None


def endpoint(prefix: str = "req", public=False):
    """Decorate a route: request id, auth (unless public), errors -> OpenAI-shaped responses.

    public: True, False, or a function of the request (a setting read at request time)."""

    def deco(fn):
        @functools.wraps(fn)
        async def wrapped(request: Request):
            request_id, bad_id = _request_id(request, prefix)
            request.scope.setdefault("state", {})["request_id"] = request_id
            metrics = request.app.state.metrics
            try:
                if bad_id is not None:
                    raise bad_id
                if not (public(request) if callable(public) else public):
                    _check_auth(request)
                response = await fn(request)
            except APIError as exc:
                return error_response(exc, request_id, metrics)
            except ServingError as exc:
                return error_response(to_api_error(exc), request_id, metrics)
            except BodyTooLarge as exc:
                return error_response(too_large(exc.args[0]), request_id, metrics)
            except ClientDisconnect:  # gone before its body arrived (or cut off by the body deadline)
                log.info("%s %s: the client went away before sending its whole body (request %s)",
                         request.method, request.url.path, request_id)
                return Response(status_code=400, headers={"Connection": "close"})
            except Exception:
                log.exception("internal error serving %s %s (request %s)", request.method, request.url.path,
                              request_id)
                return error_response(protocol.internal_error(request_id), request_id, metrics)
            response.headers.setdefault(protocol.REQUEST_ID_HEADER, request_id)
            return response

        return wrapped

    return deco


def request_context(request: Request, serving):
    """Who sent this request: request id, tenant (from the peer uid and the tenant header), peer."""
    via, uid, pid = peer(request)
    request_id = request.scope["state"]["request_id"]
    if request_id in serving.active:  # a client's X-Request-Id names one request at a time
        serving.reject("duplicate_request_id")
        raise protocol.bad_request(f"a request with id {request_id} is still in flight; send a unique X-Request-Id",
                                   "X-Request-Id", "duplicate_request_id")
    asked = request.headers.get(protocol.TENANT_HEADER)
    trusted = via == "tcp" and request.app.state.tcp_token is not None
    try:
        tenant = serving.tenants.resolve(uid, asked, trusted=trusted)
    except TenantError as exc:
        serving.reject("tenant")
        raise APIError(exc.status, str(exc), "permission_error" if exc.status == 403 else "invalid_request_error",
                       "X-Gpuserv-Tenant", "tenant_not_allowed" if exc.status == 403 else "unknown_tenant") from None
    return RequestContext(request_id, tenant, uid, pid, via)


async def not_found(request: Request, exc) -> JSONResponse:
    """Starlette's own 404/405 in OpenAI's shape."""
    status = getattr(exc, "status_code", 404)
    msg = (f"no route {request.method} {request.url.path}" if status == 404
           else f"method {request.method} is not allowed on {request.url.path}")
    err = APIError(status, msg, "invalid_request_error", None, "not_found" if status == 404 else "method_not_allowed")
    return error_response(err, f"req-{uuid.uuid4().hex[:24]}", request.app.state.metrics)


class StreamResponse:
    """A streaming ASGI response that notices a client leaving at once, not at the next write.

    The body runs beside a task that waits for `http.disconnect`; whichever
    ends first cancels the other. `on_close(disconnected)` always runs, even
    when the body never started, so the request is aborted and its admission
    released on every path.

    `body` is an async iterable of chunks, or a function of the connection's body writer (None where
    the server offers none) that returns one: a body can then write chunks itself between its own
    (openai_routes: from the engine's hand-off). Where the server offers a writer (api/server.ChunkedBody)
    the body's chunks go straight to it, not through the ASGI send.
    """

    def __init__(self, body, on_close, media_type: str, headers: dict | None = None, status_code: int = 200):
        self.body = body
        self._started = not callable(body)
        self.on_close = on_close
        self.status_code = status_code
        self.headers = {"content-type": media_type, **(headers or {})}

    async def __call__(self, scope, receive, send) -> None:
        raw = [(k.lower().encode(), str(v).encode()) for k, v in self.headers.items()]

        async def pump():
            await send({"type": "http.response.start", "status": self.status_code, "headers": raw})
            make_writer = (scope.get("state") or {}).get("body_writer")
            writer = make_writer(scope) if make_writer is not None else None
            if not self._started:
                self.body, self._started = self.body(writer), True
            if writer is None:
                async for chunk in self.body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            else:  # straight to the connection (api/server.ChunkedBody says why)
                async for chunk in self.body:
                    writer.write(chunk)
                    await writer.drain()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch():
            while True:
                if (await receive())["type"] == "http.disconnect":
                    return

        pump_task = asyncio.ensure_future(pump())
        watch_task = asyncio.ensure_future(watch())
        disconnected = False
        try:
            done, _ = await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            disconnected = watch_task in done and not pump_task.done()
        finally:
            for task in (pump_task, watch_task):
                task.cancel()
            await asyncio.gather(pump_task, watch_task, return_exceptions=True)
            close = getattr(self.body, "aclose", None) if self._started else None
            if close is not None:
                await close()
            self.on_close(disconnected)
        if pump_task.done() and not pump_task.cancelled() and pump_task.exception() is not None:
            raise pump_task.exception()

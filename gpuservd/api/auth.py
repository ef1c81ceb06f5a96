"""Who may call what: the admin role in front of every /admin route.

Anyone who may connect to the socket may generate (`/v1/*`) and read `/health`, `/ready` and
`/metrics`; the admin routes read other users' requests and prompts, cancel them, drain, reload and
unload, so they need an admin:

- over the Unix socket, the peer (SO_PEERCRED) is root, the daemon's own user, or a user whose
  tenant is marked `admin: true` in tenants.yaml;
- over TCP, the request carries the admin token (`server.admin_token_file`) as its bearer token.
  The ordinary TCP token (`server.tcp_token_file`) does not make an admin.

`AdminGuard` is ASGI middleware that decides on the path alone, before any route runs and before
the body is read, so a route added under /admin later is guarded without anyone remembering to.
"""

from __future__ import annotations

import hmac
import os
import uuid

from gpuservd.api.http import error_response
from gpuservd.api.protocol import APIError

ADMIN_PREFIX = "/admin"


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer ...` header in raw ASGI headers, else None."""
    for key, value in headers:
        if key.lower() == b"authorization":
            scheme, _, given = value.decode("latin-1").partition(" ")
            return given.strip() if scheme.lower() == "bearer" else None
    return None


def token_matches(given: str | None, token: str | None) -> bool:
    return given is not None and token is not None and hmac.compare_digest(given.encode(), token.encode())


def admin_refusal(state: dict, headers, admin_token: str | None, tenants) -> str | None:
    """None when the caller is an admin, else why not (the 403's message)."""
    cred = state.get("peer")
    if state.get("via", "unix") == "tcp":
        if admin_token is None:
            return ("the admin routes are not served over TCP without server.admin_token_file; use the Unix "
                    "socket as an admin user, or configure an admin token")
        if token_matches(bearer(headers), admin_token):
            return None
        return ("the admin routes need the admin token (server.admin_token_file) as Authorization: Bearer "
                "<token>; the ordinary TCP token only serves /v1")
    uid = cred[1] if cred else None
    if uid is not None and (uid == 0 or uid == os.getuid()):
        return None
    tenant = tenants.uid_to_tenant.get(uid) if uid is not None else None
    if tenant is not None and tenant.admin:
        return None
    return (f"uid {uid} is not an admin: /admin routes are for root, the daemon's user (uid {os.getuid()}) and "
            "users of a tenant marked admin: true in tenants.yaml")


class AdminGuard:
    """403 for every /admin/* request from a non-admin, whatever the route."""

    def __init__(self, app, state):
        self.app = app
        self.state = state  # the Starlette app's state: admin_token, serving (its tenants), metrics

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")):
            why = admin_refusal(scope.get("state") or {}, scope.get("headers") or [],
                                self.state.admin_token, self.state.serving.tenants)
            if why is not None:
                err = APIError(403, why, "permission_error", None, "admin_required")
                response = error_response(err, f"req-{uuid.uuid4().hex[:24]}", self.state.metrics)
                response.headers["Connection"] = "close"  # the body, if any, is never read
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

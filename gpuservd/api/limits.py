"""The request body cap: no route ever holds more than `server.max_body_bytes` of one body.

Starlette reads a body whole into memory before a route sees it, so the cap is enforced below the
routes, as ASGI middleware: a Content-Length over the cap is a 413 before a byte of the body is read;
a chunked body is counted as it arrives and cut off with `BodyTooLarge` the moment it passes the cap
(the endpoint wrapper turns that into the same 413). The cap is read per request, so a reload applies.
"""

from __future__ import annotations

import uuid

from gpuservd.api.http import BodyTooLarge, error_response, too_large


class BodyLimit:
    """413 for bodies over the cap; counts chunked bodies as they are received."""

    def __init__(self, app, state):
        self.app = app
        self.state = state  # the Starlette app's state: serving (its config), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.state.serving.config.server.max_body_bytes
        for key, value in scope.get("headers") or []:
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1  # h11 has already refused a malformed length; never here in practice
                if declared > limit:
                    response = error_response(too_large(limit), f"req-{uuid.uuid4().hex[:24]}", self.state.metrics)
                    response.headers["Connection"] = "close"  # the body is never read
                    await response(scope, receive, send)
                    return
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)

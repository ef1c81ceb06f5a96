"""Domain errors to HTTP: the one place a refusal from below the API gets its status and body.

Serving, the model manager and the request streams raise `ServingError`
subclasses (gpuservd/errors.py) that know nothing of HTTP bodies; `endpoint`
(http.py) and the streaming writer turn them into OpenAI-shaped errors here,
with the status, error type and headers (Retry-After) a client expects.
"""

from __future__ import annotations

from gpuservd.api.protocol import APIError
from gpuservd.errors import ServingError

# status -> OpenAI's error type for it
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 409: "invalid_request_error",
          429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


def to_api_error(exc: ServingError) -> APIError:
    """The HTTP error a client gets for a domain error."""
    headers = {}
    if exc.retry_after_s:
        headers["Retry-After"] = str(max(1, int(exc.retry_after_s)))
    return APIError(exc.status, exc.message, _TYPES.get(exc.status, "server_error"), exc.param, exc.code, headers)

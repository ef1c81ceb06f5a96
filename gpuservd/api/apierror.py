"""OpenAI-shaped errors: every error a client can cause is an `APIError` whose body has OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`) and whose message names the field and what is expected.

Pure data (no torch, no engine, no I/O); protocol.py re-exports these names; errors.py maps domain errors to them.
"""

from __future__ import annotations


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status  # HTTP status code
        self.message = message  # one line, says what to fix
        self.type = type  # OpenAI error type
        self.param = param  # the offending field, if one
        self.code = code  # machine-readable code
        self.headers = headers or {}  # extra response headers (Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(name: str, available: list[str], hint: str = "") -> APIError:
    names = ", ".join(available) if available else "none"
    return APIError(404, f"The model `{name}` does not exist or is not loaded; loaded models: {names}.{hint}",
                    "invalid_request_error", "model", "model_not_found")


def rate_limited(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, "rate_limit_error", None, "rate_limit_exceeded",
                    {"Retry-After": str(max(1, int(retry_after_s)))})


def unavailable(message: str, code: str = "unavailable", retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else {}
    return APIError(503, message, "service_unavailable", None, code, headers)


def internal_error(request_id: str) -> APIError:
    return APIError(500, f"internal error while serving request {request_id}; the daemon log has the details "
                         f"under that id", "server_error", None, "internal_error")

"""Errors that reach users.

A `UserError` is a mistake the user can fix (a bad flag, a missing model, a
malformed workload file). The CLI prints its message on one line and exits with
code 2, never a traceback; the daemon maps it to an HTTP 4xx.
"""

import enum


class UserError(Exception):
    """A mistake the user can fix; the message says what to fix."""

    exit_code = 2


class FieldError(UserError):
    """A bad value in one named field of a request; the API answers 400 with `param` set to it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param  # the request field to name, e.g. "logit_bias" or "response_format"

    def __reduce__(self):  # crosses to the daemon from an engine worker process with its field
        return (type(self), (str(self), self.param))


class ModelNotFound(UserError):
    """The named model is not in the store."""


class StoreCorrupt(UserError):
    """A store entry is damaged (missing shard, bad config); the message names the file."""


def parse_choice(enum_cls, name: str, setting: str):
    """enum_cls(name), or a UserError naming the setting and every choice (for Enum-named policies)."""
    try:
        return enum_cls(name)
    except ValueError:
        choices = ", ".join(c.value for c in enum_cls)
        raise UserError(f"{setting} {name!r} is unknown; choose one of: {choices}") from None


class Choice(str, enum.Enum):
    """A config setting with a fixed set of values: `class Mode(Choice, setting="preemption.mode")`;
    `Mode.parse(text)` is the member, or a UserError naming the setting and every choice."""

    def __init_subclass__(cls, setting: str = "", **kwargs):
        super().__init_subclass__(**kwargs)
        cls._setting = setting

    @classmethod
    def parse(cls, name: str):
        return parse_choice(cls, name, cls._setting)


class ServingError(Exception):
    """A request the daemon refuses or cannot finish, raised below the API layer.

    `gpuservd/api/errors.py` alone turns each subclass into its HTTP response
    (OpenAI-shaped body, headers). `status` is the outcome's number in HTTP's
    numbering, which the access log and the `request_finished` event record
    even when the refusal never reaches a client.
    """

    status = 500

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.message = message  # one line, says what to fix or when to retry
        self.param = param  # the request field at fault, if one
        self.code = code if code is not None else self.default_code  # machine-readable code
        self.retry_after_s = retry_after_s  # seconds a client should wait before retrying; None = no hint

    default_code: str | None = None


class InvalidRequest(ServingError):
    """The request cannot run as sent (a prompt that does not tokenize, a value the engine refuses)."""

    status = 400
    default_code = "invalid_value"


class PromptTooLong(InvalidRequest):
    """The prompt (with max_tokens) does not fit the model's context length."""

    default_code = "context_length_exceeded"


class ModelNotServed(ServingError):
    """No such model is loaded (or it failed): the message names the models there are."""

    status = 404
    default_code = "model_not_found"


class ModelPinned(ServingError):
    """An unload of a pinned model without force."""

    status = 409
    default_code = "model_pinned"


class Draining(ServingError):
    """The daemon is draining and admits no new requests."""

    status = 503
    default_code = "draining"


class ModelUnavailable(ServingError):
    """The model exists but cannot take requests now (loading, unloading, its worker exited)."""

    status = 503
    default_code = "unavailable"


class QueueFull(ServingError):
    """A per-model or per-tenant limit on waiting or unfinished requests is reached."""

    status = 429
    default_code = "rate_limit_exceeded"


class EngineFailed(ServingError):
    """The engine failed while running the request (a bug or a device fault; logged under the request id)."""

    status = 500
    default_code = "internal_error"

    def __init__(self, request_id: str):
        super().__init__(f"internal error while serving request {request_id}; the daemon log has the details "
                         "under that id")
        self.request_id = request_id

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

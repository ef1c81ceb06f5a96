"""Errors that reach users.

A `UserError` is a mistake the user can fix (a bad flag, a missing model, a
malformed workload file). The CLI prints its message on one line and exits with
code 2, never a traceback; the daemon maps it to an HTTP 4xx.
"""


class UserError(Exception):
    """A mistake the user can fix; the message says what to fix."""

    exit_code = 2


class ModelNotFound(UserError):
    """The named model is not in the store."""


class StoreCorrupt(UserError):
    """A store entry is damaged (missing shard, bad config); the message names the file."""

"""How many connections one peer may hold open at once.

Every open connection costs the daemon a file descriptor, and a process has a fixed number of them
(1024 by default for a daemon started from a shell). Without a limit per peer, one local user can
take them all with idle connections, opening new ones as the read deadline closes the old, and then
no one else's connection is accepted at all (and asyncio logs a traceback for every accept it
retries). A peer is a uid on the Unix socket; root and the daemon's own user are not limited (the
operator's tools and benchmarks). TCP is not counted: its clients are told apart by a token only
once a request is read, and a router in front of the daemon rightly holds many connections from one
address. A connection past the limit is answered 429 at once, before anything is read, and closed.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable

from gpuservd.api.apierror import APIError

log = logging.getLogger("gpuservd.api")

CONFIG_KEY = "server.max_connections_per_user"


def peer_key(peer: tuple[int, int, int] | None) -> str | None:
    """Who a Unix-socket connection is from, for counting ('uid N'); None for a peer not counted (root,
    the daemon's user, TCP, credentials that could not be read)."""
    if peer is None or peer[1] in (0, os.getuid()):
        return None
    return f"uid {peer[1]}"


class PeerConnections:
    """Open connections per peer, against a limit read at each connection (so a reload applies)."""

    def __init__(self, limit: Callable[[], int]):
        self.limit = limit
        self.open: dict[str, int] = {}
        self.warned: set[str] = set()  # peers at their limit, logged once until they drop below it

    def admit(self, key: str | None) -> bool:
        if key is None:
            return True
        n, limit = self.open.get(key, 0), self.limit()
        if limit and n >= limit:
            if key not in self.warned:
                self.warned.add(key)
                log.warning("%s has %d connections open, the limit (%s); refusing more until some close",
                            key, n, CONFIG_KEY)
            return False
        self.open[key] = n + 1
        return True

    def release(self, key: str | None) -> None:
        if key is None:
            return
        n = self.open.get(key, 0) - 1
        if n > 0:
            self.open[key] = n
        else:
            self.open.pop(key, None)
        if n < self.limit():
            self.warned.discard(key)

    def refusal(self, key: str) -> bytes:
        """The whole HTTP response for a connection over the limit (OpenAI-shaped error body)."""
        err = APIError(429, f"{key} already has {self.open.get(key, 0)} connections open to this daemon, the limit "
                            f"({CONFIG_KEY}); close some or reuse them (keep-alive)", "rate_limit_error", None,
                       "too_many_connections", {"Retry-After": "1"})
        body = json.dumps(err.body()).encode()
        extra = "".join(f"{k.lower()}: {v}\r\n" for k, v in err.headers.items())
        head = (f"HTTP/1.1 {err.status} Too Many Requests\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n{extra}connection: close\r\n\r\n")
        return head.encode() + body

"""Read deadlines for uvicorn's h11 protocol: a client must send its request in bounded time.

uvicorn has no timeout for reading a request: a client that sends its head or body a byte at a
time holds a connection (and its buffers) for as long as it likes, and a hundred of them hold a
hundred. `ReadDeadlines` (mixed in before H11Protocol) closes the connection when

- a request head is not complete within `header_timeout_s` of its first byte (or of the connection);
- a request body is not complete within `body_timeout_s` of its head. Time during which the server
  itself stopped reading (uvicorn pauses the socket while the app has not taken the body buffered so
  far) does not count: that wait is ours, not the client's.

The app then sees a disconnect (the endpoint answers nothing; the connection is gone).
"""

from __future__ import annotations

import logging

from uvicorn.protocols.http.flow_control import FlowControl

log = logging.getLogger("gpuservd.api")


class _Flow(FlowControl):
    """uvicorn's flow control, telling the protocol when reading pauses and resumes."""

    def __init__(self, transport, on_pause):
        super().__init__(transport)
        self._on_pause = on_pause

    def pause_reading(self) -> None:
        was = self.read_paused
        super().pause_reading()
        if not was:
            self._on_pause(True)

    def resume_reading(self) -> None:
        was = self.read_paused
        super().resume_reading()
        if was:
            self._on_pause(False)


class ReadDeadlines:
    """Mixin for uvicorn.protocols.http.h11_impl.H11Protocol (see the module docstring)."""

    header_timeout_s = 10.0
    body_timeout_s = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.flow = _Flow(transport, self._on_pause)
        self._timer = None
        self._timer_cycle = None  # the request whose body the deadline is for (None: a head)
        self._started = 0.0  # loop time the running timer was armed
        self._left = 0.0  # seconds of its deadline left when it was armed
        self._arm(self.header_timeout_s, None)

    def data_received(self, data: bytes) -> None:
        between = self.cycle is None or self.cycle.response_complete
        if between and self._timer is None:  # the first bytes of a keep-alive connection's next head
            self._arm(self.header_timeout_s, None)
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        if self._timer_cycle is not cycle:  # a new request's head has arrived
            self._disarm()
            self._timer_cycle = cycle
            if cycle.more_body:
                self._arm(self.body_timeout_s, cycle)
        elif not cycle.more_body:
            self._disarm()

    def request_done(self) -> None:
        """A request was answered without going through h11 (api/fast_scrape.py): its head's clock stops."""
        self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _on_pause(self, paused: bool) -> None:
        cycle = self.cycle
        if cycle is None or cycle is not self._timer_cycle or not cycle.more_body:
            return
        if paused and self._timer is not None:  # stop the clock while we are the ones not reading
            left = self._left - (self.loop.time() - self._started)
            self._disarm()
            self._left = left
        elif not paused and self._timer is None:
            self._arm(self._left, cycle)

    def _arm(self, seconds: float, cycle) -> None:
        self._disarm()
        self._timer_cycle = cycle
        self._left = seconds
        self._started = self.loop.time()
        self._timer = self.loop.call_later(max(0.0, seconds), self._expired, "body" if cycle is not None else "head")

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, what: str) -> None:
        self._timer = None
        if not self.transport.is_closing():
            limit = self.header_timeout_s if what == "head" else self.body_timeout_s
            log.info("closing a %s connection: its request %s took longer than %.0f s to arrive",
                     self.app_state.get("via", "unix"), what, limit)
            self.transport.close()

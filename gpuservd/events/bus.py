"""The live event stream behind GET /admin/events: every step, every event (step granularity:
per-second aggregates hide the steps that hurt).

Events are the dataclasses of types.py (each with one `type`: "step" for a
per-step record, "preemption", "model_load", "request_finished", ...);
`request_prompt` (a request's prompt text) goes only to readers that name it in
their types, e.g. `gpuserv record --with-prompts`. Publishing happens on the
event loop (the engine threads post there once per step). Each reader has its
own bounded queue: a reader that falls behind loses events rather than slowing
the engine, and is told how many with a `dropped` event.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Callable

from gpuservd.events.types import PRIVATE_TYPES, Dropped, Event, StepRecord, read_event


class Subscription:
    """One reader's queue; iterate it with `async for event in sub`."""

    def __init__(self, bus: "EventBus", maxsize: int, types: set[str] | None):
        self._bus = bus
        self._queue: asyncio.Queue = asyncio.Queue(maxsize)
        self.types = types  # None = all types
        self.num_dropped = 0  # events lost since the last "dropped" notice

    def offer(self, event: Event | None) -> None:
        if event is not None and (event.type not in self.types if self.types is not None
                                  else event.type in PRIVATE_TYPES):
            return
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            if event is None:  # the close sentinel must get through: make room
                self._queue.get_nowait()
                self._queue.put_nowait(None)
            else:
                self.num_dropped += 1
                self._bus.num_dropped += 1

    def __aiter__(self):
        return self

    async def __anext__(self) -> Event:
        if self.num_dropped and not self._queue.full():
            n, self.num_dropped = self.num_dropped, 0
            return Dropped(num_events=n)
        event = await self._queue.get()
        if event is None:
            raise StopAsyncIteration
        return event

    def close(self) -> None:
        self._bus.unsubscribe(self)


class EventBus:
    """Fan-out of events to the current readers; keeps the last few non-step events for new readers."""

    def __init__(self, queue_size: int = 10000, keep: int = 256):
        self.queue_size = queue_size
        self._subs: set[Subscription] = set()
        self.recent_events: deque[Event] = deque(maxlen=keep)  # non-step events, for a reader that just joined
        self.num_published = 0
        self.num_dropped = 0
        self.closed = False
        self.taps: list[Callable[[Event], None]] = []  # called with every event, synchronously (the hint monitor)

    def wants(self, kind: str) -> bool:
        """Does a reader ask for this (private) type by name?"""
        return any(sub.types is not None and kind in sub.types for sub in self._subs)

    def publish(self, event: Event | dict) -> None:
        """Event loop thread only. A dict in the JSON shape (a replayed recording, a test) is read into
        its type first."""
        if not isinstance(event, Event):
            event = read_event(event)
        self.num_published += 1
        if not isinstance(event, StepRecord) and event.type not in PRIVATE_TYPES:
            self.recent_events.append(event)
        for tap in self.taps:
            tap(event)
        for sub in self._subs:
            sub.offer(event)

    def subscribe(self, types: set[str] | None = None) -> Subscription:
        sub = Subscription(self, self.queue_size, types)
        if self.closed:
            sub.offer(None)
        else:
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    @property
    def num_subscribers(self) -> int:
        return len(self._subs)

    def close(self) -> None:
        """End every reader's stream (the daemon is stopping)."""
        self.closed = True
        for sub in list(self._subs):
            sub.offer(None)
        self._subs.clear()

"""One admitted request on the event loop side, and the model slot it runs on.

`ActiveRequest.batches()` yields the engine's outputs for the request (several
at once when the HTTP writer lagged: a stream coalesces them into one chunk);
`close()` runs on every path (finished, client gone, error): it aborts an
unfinished request in the engine and hands the request to its `on_release`
callback (admission counters, the access log). Errors are domain errors
(gpuservd/errors.py); the API layer turns them into HTTP responses.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from gpuservd.engine.loop import Accepted, AnyEngineLoop, EngineGone, Failed
from gpuservd.errors import EngineFailed, ModelUnavailable
from gpuservd.serving.tenants import Tenant
from gpuservd.wire.generation import GenerationRequest


@dataclass
class RequestContext:
    """Who sent a request and when."""

    request_id: str
    tenant: Tenant
    uid: int | None  # peer uid (SO_PEERCRED); None over TCP
    pid: int | None  # peer pid
    via: str  # "unix" | "tcp"
    arrival: float = field(default_factory=time.monotonic)
    # The id the client knows, on the extra choices of an n > 1 request (their own ids are `<group_id>-i`);
    # cancelling that id cancels every choice. "" on a request's first (or only) choice.
    group_id: str = ""


class ModelSlot:
    """One model the daemon hosts (or is loading, or failed to load)."""

    def __init__(self, name: str, config, pinned: bool = False):
        self.name = name
        self.config = config  # its EngineConfig
        self.device = ""  # the device (slot) it is placed on, e.g. cuda:1 or cpu:0; "" until routed
        self.state = "loading"  # loading | ready | unloading | failed
        self.created = time.time()  # when the load started (wall clock, for /v1/models)
        self.pinned = pinned
        self.base: str | None = None  # the base model of a derived variant (known once its load starts)
        self.error: str | None = None
        self.loop: AnyEngineLoop | None = None  # an EngineLoop, or a worker.proxy.WorkerLoop (isolation: process)
        self.worker_exit: dict | None = None  # how its engine worker process ended, when that failed it
        self.tokenizer = None  # the API's own copy: encoding never shares the engine thread's tokenizer
        self.encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"encode-{name}")
        self.max_model_len = 0
        self.loaded = asyncio.Event()
        self.num_queued = 0
        self.num_in_flight = 0
        self.finish_times: deque[float] = deque(maxlen=256)  # monotonic, for Retry-After
        self.num_layers = 0  # the model's layers (known once its load starts)
        self.layers_ready = 0  # layers on the device (a layered load serves before all are in)
        self.source_tier = ""  # where its weights came from: host | disk | disk-int8
        self.weights_bytes = 0  # on the device, in the compute dtype
        self.keep_alive_s: float | None = None  # the last request's keep_alive (None: cache.keep_alive_s)
        self.last_active = time.monotonic()  # a request arrived or finished: idle time counts from here

    def retry_after_s(self) -> int:
        """Seconds until a queue slot is likely free: the recent completion rate, 1..30."""
        now = time.monotonic()
        recent = [t for t in self.finish_times if now - t < 10.0]
        return 5 if not recent else max(1, min(30, math.ceil(10.0 / len(recent))))


def engine_gone(item: EngineGone) -> ModelUnavailable:
    """What a request gets when its model's engine worker process exits under it (a 503 to retry)."""
    return ModelUnavailable(item.message, code="model_worker_exited", retry_after_s=1)


class RequestSink:
    """Where the engine thread's outputs for one request land (on the event loop).

    The engine loop hands a whole iteration's deliveries to the event loop in one callback, which
    calls `put` once per request; the reader takes everything that arrived since it last looked in
    one `take`, so a reader that lagged a few steps renders them as one chunk. A list and at most
    one waiting future: lighter than an asyncio.Queue on a path that runs once per token per stream.
    """

    def __init__(self):
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        self.num_wakeups = 0  # times a waiting reader was woken (one per engine iteration at most)
        # listener(item) -> bool, on the event loop: True when it took the item itself (no reader woken);
        # asked only while nothing waits for the reader, so items keep their order (ActiveRequest.stream_to)
        self.listener: Callable[[object], bool] | None = None

    def put(self, item) -> None:
        listener = self.listener
        if listener is not None and not self._items and listener(item):
            return
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
            self.num_wakeups += 1

    async def _wait(self) -> None:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    async def get(self):
        """The oldest item (waits for one)."""
        await self._wait()
        return self._items.pop(0)

    def unget(self, item) -> None:
        """Put an item back in front (a reader that looked at it first and is not the one to handle it)."""
        self._items.insert(0, item)

    async def take(self) -> list:
        """Every item that arrived since the last take (waits for at least one)."""
        await self._wait()
        items, self._items = self._items, []
        return items


class ActiveRequest:
    """An admitted request: iterate `batches()` for its outputs; `close()` always runs (finally)."""

    def __init__(self, slot: ModelSlot, ctx: RequestContext, greq: GenerationRequest,
                 on_dequeue: Callable[["ActiveRequest"], None], on_release: Callable[["ActiveRequest"], None]):
        self.slot = slot
        self.ctx = ctx
        self.greq = greq
        self.sink = RequestSink()
        self.num_prompt_tokens = 0
        self.prompt_token_ids: list[int] = []  # as the engine got them (echo with logprobs names each)
        self.num_output_tokens = 0
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.queued = True
        self.done = False
        self.closed = False
        self.status = 200  # the outcome in HTTP's numbering, for the access log and request_finished
        self._on_dequeue = on_dequeue  # once: its first token came (or it ended first); it no longer counts as queued
        self._on_release = on_release  # once, from close(): it no longer counts as in flight

    async def batches(self):
        """Lists of RequestOutputs as they arrive (several when the reader lagged); ends after the last."""
        while not self.done:
            outs = []
            for item in await self.sink.take():
                if isinstance(item, Failed):
                    self.done = True
                    self.status = 500
                    raise EngineFailed(self.ctx.request_id)
                if isinstance(item, EngineGone):
                    self.done = True
                    self.status = 503
                    raise engine_gone(item)
                if isinstance(item, Accepted):
                    continue
                outs.append(item)
                self._account(item)
                if item.finished:
                    self.done = True
                    self.finish_reason = item.finish_reason.value if item.finish_reason else None
            if outs:
                yield outs

    def _account(self, out) -> None:
        self.num_output_tokens = out.num_output_tokens
        if out.new_token_ids and self.queued:
            self.first_token_at = time.monotonic()
            self._dequeue()

    def stream_to(self, handler: Callable[[object], bool] | None) -> None:
        """Hand each output that neither ends nor fails the request to handler(output) on the event loop as
        it arrives, with no reader to wake (api/openai_routes: a stream's chunk is written from the engine's
        hand-off itself, one task wake-up less per stream per step). handler returns False to leave the
        output to batches() (a client reading slowly); the last output, failures and anything after an
        output left there go to batches() as before, and so does everything from an output the handler
        raised on. None stops it."""
        if handler is None:
            self.sink.listener = None
            return

        def listen(item) -> bool:
            if isinstance(item, (Failed, EngineGone, Accepted)) or item.finished:
                return False
            try:
                taken = handler(item)
            except Exception:  # it runs in the hand-off of every stream: its reader meets the failure instead
                self.sink.listener = None
                return False
            if taken:
                self._account(item)
            return taken

        self.sink.listener = listen

    def abort(self) -> None:
        if not self.done and self.slot.loop is not None:
            self.slot.loop.abort(self.ctx.request_id)

    def _dequeue(self) -> None:
        if self.queued:
            self.queued = False
            self.slot.num_queued -= 1
            self._on_dequeue(self)

    def close(self, disconnected: bool = False) -> None:
        """Release admission counters, abort if unfinished (client gone), log the request."""
        if self.closed:
            return
        self.closed = True
        if not self.done:
            self.abort()
            self.finish_reason = "abort"
            if disconnected:
                self.status = 499  # nginx's "client closed request", in the log only
        self._dequeue()
        self._on_release(self)

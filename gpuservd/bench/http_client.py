"""The one streaming OpenAI client every HTTP benchmark target is driven by.

gpuserv's daemon (its Unix socket or TCP), llama.cpp's `llama-server` and
vLLM's OpenAI server get the same requests from this same code: each workload
request is a streaming `/v1/completions` call sent at its arrival offset, with
the prompt as token ids, `max_tokens` = the request's output length,
`ignore_eos`, greedy (temperature 0), and `stream_options.include_usage`.
Only the server-specific extras differ (`Endpoint.extra_body`, e.g. gpuserv's
`detokenize: false`).

The streams are read by sse_stream.py (an asyncio Protocol, not httpx): the
client shares the CPUs with the server it measures, so its CPU per event is
kept small; it costs every server the same. `Endpoint.client()` (httpx) is
for the few plain calls around a run (status, warm-up checks).

A token exists, for timing, when the SSE chunk carrying it arrives. Each
request's output length is checked: the server's own `usage.completion_tokens`
when it sends one, else the tokens counted in the stream (token ids when the
chunks carry them, else one per non-empty text chunk). A request that got
fewer (or more) tokens than asked is recorded in `token_check`, so a server
that stops early can not look faster than it is.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import httpx
import orjson

from gpuservd.bench.records import RequestTiming
from gpuservd.bench.sse_stream import StreamFailed, post_sse

# Long requests on a loaded 2-core machine can go quiet for minutes while a burst's prefills run, but a
# server that has died must not hang the benchmark forever.
READ_TIMEOUT_S = 900.0


@dataclass
class Endpoint:
    """Where a server listens and what it wants in each request body besides the common fields."""

    base_url: str  # http://127.0.0.1:PORT, or any http://NAME with uds set
    model: str  # the model name the server answers to
    uds: str | None = None  # a Unix socket path (gpuserv's own transport), else TCP
    extra_body: dict = field(default_factory=dict)  # server-specific fields, merged into every request
    per_request: Callable | None = None  # WorkloadRequest -> more fields for that request (e.g. priority)

    @property
    def transport(self) -> str:
        return f"unix:{self.uds}" if self.uds else self.base_url

    def client(self) -> httpx.AsyncClient:
        """An async client with no connection limit (a burst opens one connection per request)."""
        transport = httpx.AsyncHTTPTransport(uds=self.uds) if self.uds else None
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(connect=60.0, read=READ_TIMEOUT_S, write=60.0, pool=None)
        return httpx.AsyncClient(transport=transport, base_url=self.base_url, timeout=timeout, limits=limits)

    def body(self, prompt_token_ids: Sequence[int], max_tokens: int, request=None) -> dict:
        """The request body: the common fields, then the server's extras."""
        body = {"model": self.model, "prompt": list(prompt_token_ids), "max_tokens": int(max_tokens),
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        body.update(self.extra_body)
        if request is not None and self.per_request is not None:
            body.update(self.per_request(request))
        return body


@dataclass
class StreamCount:
    """What one streamed response delivered."""

    streamed: int = 0  # tokens counted in the chunks
    usage: int | None = None  # the server's usage.completion_tokens, when it sent one
    by_token_ids: bool = False  # whether `streamed` counted token ids (exact) or non-empty text chunks
    first_token_at: float | None = None  # perf_counter when the first chunk with a token arrived

    @property
    def tokens(self) -> int:
        """The output length: the server's usage when given, else the count from the stream."""
        return self.usage if self.usage is not None else self.streamed

    def problem(self, expected: int) -> str | None:
        """Why this response is not exactly `expected` tokens long, or None when it is."""
        if self.tokens != expected:
            src = "usage.completion_tokens" if self.usage is not None else "streamed tokens"
            return f"{src} = {self.tokens}, expected {expected}"
        if self.usage is not None and self.by_token_ids and self.streamed != self.usage:
            return f"streamed {self.streamed} token ids but usage says {self.usage}"
        return None


def count_chunk(payload: bytes, count: StreamCount, now: float) -> None:
    """Fold one SSE `data:` payload into `count` (payloads that are not a JSON object are ignored)."""
    if not payload.startswith(b"{"):
        return  # "[DONE]"
    chunk = orjson.loads(payload)  # the client shares the CPUs with the server it measures: parse fast
    added = 0
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids")
        if ids is not None:
            count.by_token_ids = True
            added += len(ids)
        elif isinstance(chunk.get("tokens"), list):  # llama-server's own field, with return_tokens
            count.by_token_ids = True
            added += len(chunk["tokens"])
        elif choice.get("text"):
            added += 1
    usage = chunk.get("usage")
    if usage and usage.get("completion_tokens") is not None:
        count.usage = int(usage["completion_tokens"])
    if added:
        count.streamed += added
        if count.first_token_at is None:
            count.first_token_at = now


async def stream_one(endpoint: Endpoint, body: dict) -> StreamCount:
    """POST one streaming completion and count what comes back; raises StreamFailed on an HTTP error
    status or a broken stream, OSError when the server can not be reached."""
    count = StreamCount()
    clock = time.perf_counter
    await post_sse(endpoint.base_url, endpoint.uds, "/v1/completions", orjson.dumps(body),
                   lambda payload: count_chunk(payload, count, clock()), read_timeout_s=READ_TIMEOUT_S)
    return count


@dataclass
class Replay:
    """One workload replayed against one endpoint."""

    wall_s: float
    timings: list[RequestTiming]
    errors: list[str]  # requests that failed outright (HTTP error, dropped connection)
    problems: list[tuple[str, int, int, str]]  # (request id, expected, got, why) for wrong-length outputs
    count_source: str  # "usage", "token_ids" or "text_chunks": what the lengths were checked against

    def token_check(self, requests: Sequence) -> dict:
        expected = sum(r.output_tokens for r in requests)
        counted = sum(t.output_tokens for t in self.timings)
        return {"expected": expected, "counted": counted, "source": self.count_source,
                "ok": not self.errors and not self.problems and expected == counted,
                "wrong_length": [list(p) for p in self.problems[:20]], "num_wrong_length": len(self.problems),
                "num_failed": len(self.errors)}


async def _timed(endpoint: Endpoint, r, t0: float, out: Replay, sources: set) -> None:
    await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
    try:
        count = await stream_one(endpoint, endpoint.body(r.prompt_token_ids, r.output_tokens, r))
    except (StreamFailed, OSError, orjson.JSONDecodeError) as exc:
        out.errors.append(f"{r.request_id}: {type(exc).__name__}: {exc}")
        return
    done = time.perf_counter() - t0
    sources.add("usage" if count.usage is not None else "token_ids" if count.by_token_ids else "text_chunks")
    why = count.problem(r.output_tokens)
    if why:
        out.problems.append((r.request_id, r.output_tokens, count.tokens, why))
    first = count.first_token_at - t0 if count.first_token_at is not None else done
    out.timings.append(RequestTiming(r.request_id, r.cls, r.arrival_s, first, done,
                                     len(r.prompt_token_ids), count.tokens))


async def replay_async(endpoint: Endpoint, requests: Sequence) -> Replay:
    """Send every request at its arrival offset (concurrently) and time each; see the module doc."""
    out = Replay(0.0, [], [], [], "")
    sources: set[str] = set()
    t0 = time.perf_counter()
    await asyncio.gather(*(_timed(endpoint, r, t0, out, sources) for r in requests))
    out.wall_s = time.perf_counter() - t0
    out.count_source = "+".join(sorted(sources))
    out.timings.sort(key=lambda t: t.request_id)
    return out


async def warm_up(endpoint: Endpoint, prompt_token_ids: Sequence[int], max_tokens: int = 4) -> StreamCount:
    """One short request before the clock starts (first-call kernel set-up is not measured)."""
    return await stream_one(endpoint, endpoint.body(prompt_token_ids, max_tokens))


def replay(endpoint: Endpoint, requests: Sequence, warm_prompt: Sequence[int] | None = None) -> Replay:
    """replay_async in a fresh event loop, after a warm-up request when `warm_prompt` is given."""
    async def run() -> Replay:
        if warm_prompt is not None:
            await warm_up(endpoint, warm_prompt)
        return await replay_async(endpoint, requests)

    return asyncio.run(run())

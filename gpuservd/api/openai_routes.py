"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models.

A request with n > 1 or best_of runs one engine request per choice
(choices.py renders each); best_of returns the n with the highest summed
logprob. Usage counts the prompt once and every choice's tokens.

A stream ends with `data: [DONE]`; with `stream_options.include_usage` the
chunk before it carries the usage. A client that goes away mid-request (stream
or not) has its request aborted at once, so its KV blocks are free within one
engine step. An engine failure after the stream started is sent as a
`data: {"error": ...}` event before `[DONE]`, as vLLM does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gpuservd.api import protocol, responses
from gpuservd.api.choices import Choice
from gpuservd.api.errors import to_api_error
from gpuservd.api.http import StreamResponse, endpoint, request_context
from gpuservd.api.protocol import GenerationRequest
from gpuservd.errors import ServingError
from gpuservd.serving.request_stream import ActiveRequest
from gpuservd.serving.serving import Serving


async def _start_all(serving: Serving, greq: GenerationRequest, ctx) -> list[ActiveRequest]:
    """Admit one engine request per choice (same prompt; the KV cache shares its blocks between them).
    Choice i > 0 runs as `<request id>-i`, with seed + i when a seed is set. All or none are admitted."""
    rank = greq.best_of is not None and greq.best_of > greq.n and greq.logprobs is None
    subs = []
    for i in range(greq.num_choices):
        sub = replace(greq, seed=None if greq.seed is None else greq.seed + i,
                      logprobs=0 if rank else greq.logprobs)  # best_of ranks by the summed logprobs
        subs.append((sub, ctx if i == 0 else replace(ctx, request_id=f"{ctx.request_id}-{i}",
                                                     group_id=ctx.request_id)))
    if len(subs) == 1:
        return [await serving.start(*subs[0])]
    started = await asyncio.gather(*(serving.start(g, c) for g, c in subs), return_exceptions=True)
    failed = next((r for r in started if isinstance(r, BaseException)), None)
    if failed is not None:
        for r in started:
            if isinstance(r, ActiveRequest):
                r.close()
        raise failed
    return list(started)


async def _batches(c: Choice):
    """(choice, item) for one choice: item is a list of its outputs, an APIError (the engine failed mid-stream:
    the status line is long gone) or None (it ended)."""
    try:
        async for outs in c.active.batches():
            yield c, outs
    except ServingError as exc:
        yield c, to_api_error(exc)
    yield c, None


async def _merged(choices: list[Choice]):
    """Every choice's (choice, item) as they come (n > 1: a task per choice feeds one queue)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice):
        async for pair in _batches(c):
            await queue.put(pair)

    tasks = [asyncio.ensure_future(pump(c)) for c in choices]
    try:
        left = len(choices)
        while left:
            pair = await queue.get()
            left -= pair[1] is None
            yield pair
    finally:
        for t in tasks:
            t.cancel()


def _direct(c: Choice, writer):
    """The handler that writes a choice's chunk from the engine's hand-off (ActiveRequest.stream_to): while
    the client keeps up, an output costs no task wake-up, no generator and no ASGI send; when it lags the
    output is left to the stream's reader, which waits for the client and sends what piled up as one chunk."""
    def handle(out) -> bool:
        if not writer.ready:
            return False
        data = c.chunk([out])
        if data is not None:
            writer.write(data)
        return True

    return handle


async def _events(choices: list[Choice], greq: GenerationRequest, rid: str, created: int, writer=None):
    """SSE body of a streaming request: the choices' chunks as they come, then usage and [DONE].

    One choice (the usual stream) reads its request's outputs directly, with no task, queue or generator
    between them and the response: this runs once per engine step for every stream. With the connection's
    body writer (api/server.ChunkedBody), its chunks are written from the engine's hand-off itself."""
    for c in choices:
        opening = c.opening()
        if opening is not None:
            yield opening
    if len(choices) == 1:
        c = choices[0]
        if writer is not None:  # after the opening: it is written before this generator runs on
            c.active.stream_to(_direct(c, writer))
        try:
            async for outs in c.active.batches():
                data = c.chunk(outs)
                if data is not None:
                    yield data
        except ServingError as exc:
            yield responses.sse(to_api_error(exc).body())
        finally:
            c.active.stream_to(None)
    else:
        merged = _merged(choices)
        try:
            async for c, item in merged:
                if item is None:
                    continue
                data = responses.sse(item.body()) if not isinstance(item, list) else c.chunk(item)
                if data is not None:
                    yield data
        finally:
            await merged.aclose()
    if greq.include_usage:
        yield responses.sse(responses.usage_chunk(greq.kind, rid, greq.model, created, *_usage(choices)))
    yield responses.SSE_DONE


def _usage(choices: list[Choice]) -> tuple[int, int]:
    """(prompt tokens, completion tokens): the prompt counts once, every choice's output counts."""
    return choices[0].active.num_prompt_tokens, sum(c.active.num_output_tokens for c in choices)


async def _collect(choices: list[Choice], request: Request) -> None:
    """Run every choice to the end; abort them all if the client goes away meanwhile."""
    disconnected = False

    async def watch():
        nonlocal disconnected
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                for c in choices:
                    c.active.abort()
                return

    async def run(c: Choice):
        async for outs in c.active.batches():
            c.add(outs)

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.gather(*(run(c) for c in choices))
    finally:
        watcher.cancel()
        for c in choices:
            c.active.close(disconnected)


def _response(choices: list[Choice], greq: GenerationRequest, rid: str, created: int) -> dict:
    if greq.best_of is not None and greq.best_of > greq.n:
        picked = sorted(choices, key=lambda c: c.sum_logprob, reverse=True)[:greq.n]
        bodies = [c.body(i) for i, c in enumerate(picked)]
    else:
        bodies = [c.body() for c in choices]
    obj = "chat.completion" if greq.kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": greq.model, "choices": bodies,
            "usage": responses.usage(*_usage(choices))}


def routes(serving: Serving) -> list[Route]:
    async def generate(request: Request, kind: str):
        body = protocol.parse_json(await request.body())
        max_n = serving.config.server.max_n
        greq = protocol.parse_chat(body, max_n) if kind == "chat" else protocol.parse_completion(body, max_n)
        ctx = request_context(request, serving)
        actives = await _start_all(serving, greq, ctx)
        greq.model = actives[0].greq.model  # the version the router picked
        created = int(time.time())
        choices = [Choice(i, a, a.greq, created, greq.logprobs is not None) for i, a in enumerate(actives)]
        headers = {protocol.REQUEST_ID_HEADER: ctx.request_id}
        if greq.stream:
            def close(disconnected: bool = False):
                for a in actives:
                    a.close(disconnected)

            return StreamResponse(lambda writer: _events(choices, greq, ctx.request_id, created, writer),
                                  on_close=close, media_type="text/event-stream",
                                  headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await _collect(choices, request)
        return JSONResponse(_response(choices, greq, ctx.request_id, created), headers=headers)

    @endpoint(prefix="cmpl")
    async def completions(request: Request):
        return await generate(request, "completion")

    @endpoint(prefix="chatcmpl")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    def model_card(name: str) -> dict:
        """vLLM's card: root names the weights the model is built from, parent the base of a derived variant."""
        slot = serving.slots[name]
        return {"id": name, "object": "model", "created": int(slot.created), "owned_by": "gpuserv",
                "root": name, "parent": slot.base, "max_model_len": slot.max_model_len, "state": slot.state}

    @endpoint()
    async def list_models(request: Request):
        return JSONResponse({"object": "list", "data": [model_card(n) for n in serving.model_names()]})

    @endpoint()
    async def get_model(request: Request):
        name = request.path_params["model"]
        if name not in serving.model_names():
            raise protocol.model_not_found(name, serving.model_names())
        return JSONResponse(model_card(name))

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    ]


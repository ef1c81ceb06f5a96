"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models.

A stream ends with `data: [DONE]`; with `stream_options.include_usage` the
chunk before it carries the usage. A client that goes away mid-request (stream
or not) has its request aborted at once, so its KV blocks are free within one
engine step. An engine failure after the stream started is sent as a
`data: {"error": ...}` event before `[DONE]`, as vLLM does.
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from gpuservd.api import protocol, responses
from gpuservd.api.errors import to_api_error
from gpuservd.api.http import StreamResponse, endpoint, request_context
from gpuservd.errors import ServingError
from gpuservd.request_stream import ActiveRequest
from gpuservd.serving import Serving


def _token_ids(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


async def _events(active: ActiveRequest, created: int):
    """SSE body of a streaming request."""
    g = active.greq
    kind, rid, model = g.kind, active.ctx.request_id, g.model
    usage = g.include_usage
    ids = g.return_token_ids
    encoder = responses.ChunkEncoder(kind, rid, model, created, ids, usage)
    try:
        if kind == "chat":
            yield responses.sse(responses.stream_chunk(kind, rid, model, created, "", role=True, include_usage=usage))
        async for outs in active.batches():
            text = "".join(o.new_text for o in outs)
            finish = outs[-1].finish_reason.value if outs[-1].finished and outs[-1].finish_reason else None
            toks = _token_ids(outs)
            if text or finish or (ids and toks):
                yield encoder.encode(text, finish, toks)
        if usage:
            yield responses.sse(responses.usage_chunk(kind, rid, model, created, active.num_prompt_tokens,
                                                    active.num_output_tokens))
    except ServingError as exc:  # the engine failed mid-stream: the status line is long gone
        yield responses.sse(to_api_error(exc).body())
    yield responses.SSE_DONE


async def _collect(active: ActiveRequest, request: Request) -> dict:
    """Run a non-streaming request to the end; abort it if the client goes away meanwhile."""
    disconnected = False

    async def watch():
        nonlocal disconnected
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                disconnected = True
                active.abort()
                return

    watcher = asyncio.ensure_future(watch())
    text: list[str] = []
    ids: list[int] = []
    try:
        async for outs in active.batches():
            text.extend(o.new_text for o in outs)
            ids.extend(_token_ids(outs))
    finally:
        watcher.cancel()
        active.close(disconnected)
    g = active.greq
    build = responses.chat_response if g.kind == "chat" else responses.completion_response
    return build(active.ctx.request_id, g.model, "".join(text), active.finish_reason, active.num_prompt_tokens,
                 active.num_output_tokens, ids if g.return_token_ids else None)


def routes(serving: Serving) -> list[Route]:
    async def generate(request: Request, kind: str):
        body = protocol.parse_json(await request.body())
        greq = protocol.parse_chat(body) if kind == "chat" else protocol.parse_completion(body)
        ctx = request_context(request, serving)
        active = await serving.start(greq, ctx)
        headers = {protocol.REQUEST_ID_HEADER: ctx.request_id}
        if greq.stream:
            return StreamResponse(_events(active, int(time.time())), on_close=active.close,
                                  media_type="text/event-stream",
                                  headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await _collect(active, request), headers=headers)

    @endpoint(prefix="cmpl")
    async def completions(request: Request):
        return await generate(request, "completion")

    @endpoint(prefix="chatcmpl")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    def model_card(name: str) -> dict:
        slot = serving.slots[name]
        return {"id": name, "object": "model", "created": int(slot.created), "owned_by": "gpuserv",
                "max_model_len": slot.max_model_len, "state": slot.state}

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


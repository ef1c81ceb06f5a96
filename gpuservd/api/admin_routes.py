"""Admin routes: status, models (load/unload/pin), requests (list/cancel), drain, reload, events, metrics.

`GET /admin/events` streams every per-step record and every event as NDJSON
(one JSON object per line; the default) or as SSE (`Accept:
text/event-stream` or `?format=sse`). `?types=step,preemption` filters;
`?recent=N` first replays the last N step records of each model and the
recent non-step events, so a console that connects late has context.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gpuservd.api import protocol
from gpuservd.api.fast_scrape import scrape
from gpuservd.api.http import StreamResponse, endpoint
from gpuservd.api.metrics import CONTENT_TYPE
from gpuservd.api.protocol import APIError
from gpuservd.errors import ModelNotFound, UserError
from gpuservd.events.types import SCHEMA_VERSION, Event, Hello, StepRecord, Versions
from gpuservd.serving.serving import Serving


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    body = protocol.parse_json(raw)
    if not isinstance(body, dict):
        raise protocol.bad_request("the request body must be a JSON object", None, "invalid_type")
    return body


def _opt(body: dict, key: str, kind, default):
    v = body.get(key, default)
    if v is None:
        return default
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
        raise protocol.bad_request(f"{key} must be a {kind.__name__}", key, "invalid_type")
    if kind is float and v < 0:
        raise protocol.bad_request(f"{key} must be >= 0 seconds", key)
    return v


def routes(serving: Serving, controller) -> list[Route]:
    """Every admin route; controller: the daemon (drain, reload), see gpuservd.daemon.run.Daemon."""
    return (_probe_routes(serving) + _request_routes(serving) + _model_routes(serving)
            + _lifecycle_routes(serving, controller) + _event_routes(serving))


def _probe_routes(serving: Serving) -> list[Route]:
    """Liveness, readiness, metrics and status: what probes, scrapers and `gpuserv status` read."""

    @endpoint(public=True)
    async def health(request: Request):
        dead = [n for n, s in serving.slots.items() if s.state == "ready" and s.loop is not None and not s.loop.alive]
        if dead:
            return JSONResponse({"status": "unhealthy", "dead_engines": dead}, status_code=503)
        if serving.state == "draining":  # a router's health check takes the daemon out of its rotation
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @endpoint(public=True)
    async def ready(request: Request):
        names = serving.model_names()
        if serving.state != "serving" or not names:
            why = serving.state if serving.state != "serving" else "no model is ready"
            return JSONResponse({"ready": False, "reason": why}, status_code=503)
        return JSONResponse({"ready": True, "models": names})

    @endpoint()
    async def status(request: Request):
        return JSONResponse(serving.status())

    @endpoint(public=lambda _request: serving.config.server.metrics_public)
    async def metrics(request: Request):
        # a plain GET /metrics is answered before it gets here (api/fast_scrape.py), with the same body and
        # headers; this route serves the rest (a query string, HTTP/1.0, a split or pipelined request, ...)
        body, timing = scrape(request.app.state)
        return Response(body, media_type=CONTENT_TYPE, headers={"Server-Timing": timing})

    return [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/admin/status", status, methods=["GET"]),
    ]


def _request_routes(serving: Serving) -> list[Route]:
    """In-flight requests: list and cancel."""

    @endpoint()
    async def list_requests(request: Request):
        return JSONResponse({"requests": await serving.requests()})

    @endpoint()
    async def cancel(request: Request):
        rid = request.path_params["request_id"]
        if not serving.cancel(rid):
            raise APIError(404, f"no request {rid} in flight", "invalid_request_error", "request_id",
                           "request_not_found")
        return JSONResponse({"request_id": rid, "cancelled": True})

    return [
        Route("/admin/requests", list_requests, methods=["GET"]),
        Route("/admin/requests/{request_id}/cancel", cancel, methods=["POST"]),
    ]


def _model_routes(serving: Serving) -> list[Route]:
    """Models: load, unload, pin, version weights, prefix-cache reset."""

    @endpoint()
    async def load(request: Request):
        name = request.path_params["model"]
        body = await _json_body(request)
        pinned = _opt(body, "pinned", bool, False)
        try:
            slot = await serving.load(name, pinned=pinned)
        except ModelNotFound as exc:
            raise APIError(404, str(exc), "invalid_request_error", "model", "model_not_found") from None
        except UserError as exc:
            raise protocol.bad_request(str(exc), "model", "model_load_failed") from None
        if slot.state == "failed":
            raise APIError(500, f"model {name} failed to load: {slot.error}", "server_error", "model",
                           "model_load_failed")
        return JSONResponse(asdict(serving.model_status(slot)))

    @endpoint()
    async def unload(request: Request):
        body = await _json_body(request)
        result = await serving.unload(request.path_params["model"], _opt(body, "timeout", float, None),
                                      _opt(body, "force", bool, False))
        return JSONResponse(result)

    @endpoint()
    async def pin(request: Request):
        body = await _json_body(request)
        return JSONResponse(serving.pin(request.path_params["model"], _opt(body, "pinned", bool, True)))

    @endpoint()
    async def prefix_cache_reset(request: Request):
        name = request.path_params["model"]
        forgotten = await serving.models.reset_prefix_cache(name)
        return JSONResponse({"model": name, "num_blocks_forgotten": forgotten})

    @endpoint()
    async def versions(request: Request):
        body = await _json_body(request)
        weights = body.get("weights") if isinstance(body, dict) else None
        if weights is not None and not isinstance(weights, dict):
            raise protocol.bad_request("weights must be an object of version name to weight", "weights")
        result = serving.set_versions(request.path_params["model"], weights)
        serving.bus.publish(Versions(**result))
        return JSONResponse(result)

    return [
        Route("/admin/models/{model}/load", load, methods=["POST"]),
        Route("/admin/models/{model}/unload", unload, methods=["POST"]),
        Route("/admin/models/{model}/pin", pin, methods=["POST"]),
        Route("/admin/models/{model}/versions", versions, methods=["POST"]),
        Route("/admin/models/{model}/prefix_cache/reset", prefix_cache_reset, methods=["POST"]),
    ]


def _lifecycle_routes(serving: Serving, controller) -> list[Route]:
    """Drain, resume and reload: the daemon's own lifecycle (controller)."""

    @endpoint()
    async def drain(request: Request):
        body = await _json_body(request)
        timeout = _opt(body, "timeout", float, None)
        exit_after = _opt(body, "exit", bool, True)
        result = await controller.drain(timeout, exit_after=exit_after)
        return JSONResponse({**result, "exiting": exit_after})

    @endpoint()
    async def resume(request: Request):
        serving.resume()
        return JSONResponse({"state": serving.state})

    @endpoint()
    async def reload(request: Request):
        return JSONResponse(await controller.reload())

    return [
        Route("/admin/drain", drain, methods=["POST"]),
        Route("/admin/resume", resume, methods=["POST"]),
        Route("/admin/reload", reload, methods=["POST"]),
    ]


def _event_routes(serving: Serving) -> list[Route]:
    """The live event stream (module docstring)."""

    @endpoint()
    async def events(request: Request):
        q = request.query_params
        sse = q.get("format") == "sse" or "text/event-stream" in request.headers.get("accept", "")
        types = {t for t in q.get("types", "").split(",") if t} or None
        if types and "request_prompt" in types and not serving.config.server.log_prompts:
            raise APIError(403, "prompt text is not published: server.log_prompts is false in the daemon's config",
                           "permission_error", "types", "prompts_disabled")
        try:
            recent = int(q.get("recent", "0"))
        except ValueError:
            raise protocol.bad_request("recent must be an integer", "recent") from None
        sub = serving.bus.subscribe(types)
        replay = []
        if recent > 0:
            replay = [e for e in serving.bus.recent_events if types is None or e.type in types]
            if types is None or StepRecord.type in types:
                for slot in list(serving.slots.values()):
                    if slot.loop is not None:
                        replay.extend(slot.loop.recent_steps(recent))
                replay.sort(key=lambda e: e.t)

        def encode(event: Event) -> bytes:
            line = json.dumps(event.to_json(), separators=(",", ":"))
            return f"event: {event.type}\ndata: {line}\n\n".encode() if sse else (line + "\n").encode()

        async def body():
            yield encode(Hello(models=serving.model_names(False), state=serving.state, schema=SCHEMA_VERSION))
            for event in replay:
                yield encode(event)
            async for event in sub:
                yield encode(event)

        return StreamResponse(body(), on_close=lambda _disconnected: sub.close(),
                              media_type="text/event-stream" if sse else "application/x-ndjson",
                              headers={"Cache-Control": "no-cache"})

    return [Route("/admin/events", events, methods=["GET"])]

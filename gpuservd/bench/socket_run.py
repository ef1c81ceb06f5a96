"""The benchmark workload through the daemon's socket (`gpuserv bench --target socket`).

The same requests as the in-process run (gpuservd.bench.engine_run): prompt
token ids, forced lengths (ignore_eos), greedy, no detokenization (the
`detokenize: false` extension) so both runs do the same work; each request is
a streaming /v1/completions call sent at its arrival offset. Times are what an
HTTP client sees: a token exists when its SSE chunk arrives.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Sequence

import httpx

from gpuservd.bench.daemon_cpu import cpu_per_token
from gpuservd.bench.records import RequestTiming, SystemRun


async def _one(client: httpx.AsyncClient, r, model: str, t0: float, timings: list, errors: list) -> None:
    await asyncio.sleep(max(0.0, r.arrival_s - (time.perf_counter() - t0)))
    body = {"model": r.model or model, "prompt": r.prompt_token_ids, "max_tokens": r.output_tokens,
            "temperature": 0, "ignore_eos": True, "detokenize": False, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}, "priority": r.priority}
    first = None
    n = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                errors.append(f"{r.request_id}: HTTP {resp.status_code} {(await resp.aread())[:200]!r}")
                return
            async for line in resp.aiter_lines():
                # Parse only the usage chunk: the client shares the CPUs with the daemon it measures.
                if first is None and '"token_ids":[' in line and '"token_ids":[]' not in line:
                    first = time.perf_counter() - t0
                elif line.startswith('data: {') and '"usage":{' in line:
                    n = json.loads(line[6:])["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        errors.append(f"{r.request_id}: {type(exc).__name__}: {exc}")
        return
    done = time.perf_counter() - t0
    timings.append(RequestTiming(r.request_id, r.cls, r.arrival_s, first if first is not None else done, done,
                                 len(r.prompt_token_ids), n))


async def _run(socket_path: Path, requests: Sequence, model: str) -> SystemRun:
    transport = httpx.AsyncHTTPTransport(uds=str(socket_path))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(transport=transport, base_url="http://gpuserv", timeout=None, limits=limits) as c:
        warm = {"model": model or requests[0].model, "prompt": list(range(100, 116)), "max_tokens": 4,
                "ignore_eos": True, "detokenize": False}
        (await c.post("/v1/completions", json=warm)).raise_for_status()
        before = (await c.get("/admin/status")).json()
        timings: list[RequestTiming] = []
        errors: list[str] = []
        t0, client0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(_one(c, r, model, t0, timings, errors) for r in requests))
        wall, client_cpu = time.perf_counter() - t0, time.process_time() - client0
        after = (await c.get("/admin/status")).json()
    by_id = {r.request_id: r for r in requests}
    steps = sum(m["num_steps"] for m in after["models"]) - sum(m["num_steps"] for m in before["models"])
    extra = {"target": "socket", "num_steps": steps, "errors": errors,
             "outputs_exact": not errors and all(t.output_tokens == by_id[t.request_id].output_tokens
                                                 for t in timings)}
    extra.update(cpu_per_token(before, after, sum(t.output_tokens for t in timings), client_cpu))
    return SystemRun("gpuserv-socket", wall, sorted(timings, key=lambda t: t.request_id), extra)


def run_socket(socket_path: str | Path, requests: Sequence, model: str = "") -> SystemRun:
    """Replay requests (WorkloadRequest) through the daemon at socket_path; per-request timings as in-process."""
    return asyncio.run(_run(Path(socket_path), requests, model))

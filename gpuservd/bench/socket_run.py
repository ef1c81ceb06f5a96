"""The benchmark workload through the daemon's socket (`gpuserv bench --target socket`).

The same requests as the in-process run (gpuservd.bench.engine_run): prompt
token ids, forced lengths (ignore_eos), greedy, no detokenization (the
`detokenize: false` extension) so both runs do the same work; each request is
a streaming /v1/completions call sent at its arrival offset, by the shared
client in gpuservd.bench.http_client (the one that also drives the HTTP peers).
Times are what an HTTP client sees: a token exists when its SSE chunk arrives.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Sequence

from gpuservd.bench.daemon_cpu import cpu_per_token
from gpuservd.bench.http_client import Endpoint, replay_async, warm_up
from gpuservd.bench.records import SystemRun

# gpuserv's extensions: token ids in, token ids out, no text (the in-process run detokenizes nothing either).
GPUSERV_EXTRA = {"detokenize": False, "return_token_ids": True}


def gpuserv_endpoint(model: str, socket_path: str | Path | None = None, base_url: str = "http://gpuserv") -> Endpoint:
    """The daemon at `socket_path` (or at `base_url` over TCP), with gpuserv's body extensions."""
    return Endpoint(base_url=base_url, model=model, uds=str(socket_path) if socket_path else None,
                    extra_body=dict(GPUSERV_EXTRA), per_request=_per_request)


def _per_request(r) -> dict:
    # A workload may name a model per request (several models behind one daemon).
    return {"priority": r.priority, **({"model": r.model} if r.model else {})}


def _steps(status: dict) -> int:
    return sum(m["num_steps"] for m in status["models"])


async def _run(endpoint: Endpoint, requests: Sequence) -> SystemRun:
    async with endpoint.client() as c:
        await warm_up(endpoint, list(range(100, 116)))
        before = (await c.get("/admin/status")).json()
        client0 = time.process_time()
        rep = await replay_async(endpoint, requests)
        client_cpu = time.process_time() - client0
        after = (await c.get("/admin/status")).json()
    check = rep.token_check(requests)
    extra = {"target": "socket", "transport": endpoint.transport, "num_steps": _steps(after) - _steps(before),
             "errors": rep.errors + [f"{rid}: {why}" for rid, _, _, why in rep.problems],
             "outputs_exact": check["ok"], "token_check": check}
    extra.update(cpu_per_token(before, after, sum(t.output_tokens for t in rep.timings), client_cpu))
    return SystemRun("gpuserv-socket", rep.wall_s, rep.timings, extra)


def run_socket(socket_path: str | Path, requests: Sequence, model: str = "") -> SystemRun:
    """Replay requests (WorkloadRequest) through the daemon at socket_path; per-request timings as in-process."""
    return asyncio.run(_run(gpuserv_endpoint(model or requests[0].model, socket_path), requests))

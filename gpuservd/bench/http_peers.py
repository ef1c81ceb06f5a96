"""The HTTP targets of `gpuserv bench`: a server started on loopback, the workload through the shared client.

`run_server` is the one procedure every HTTP target goes through, gpuserv's
own daemon (gpuserv_http.py) and each peer here: start the server, wait until
it is ready, send a warm-up request, then replay the workload with
http_client.py while the server's process tree is sampled for its RSS and CPU
seconds, and stop it. `run_http_peer` installs a peer on first use; a peer
that cannot be installed or started raises PeerUnavailable, which
`gpuserv bench` turns into a skipped entry with the reason in the report.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from pathlib import Path
from typing import Sequence

from gpuservd.bench import llama_peer, vllm_peer
from gpuservd.bench.http_client import Endpoint, replay_async, warm_up
from gpuservd.bench.peer_job import PeerJob, PeerUnavailable
from gpuservd.bench.proc_tree import TreeSampler
from gpuservd.bench.records import SystemRun
from gpuservd.bench.server_process import ServerFailed, ServerProcess, ServerSpec, free_port

HTTP_PEERS = {llama_peer.NAME: llama_peer, vllm_peer.NAME: vllm_peer}
PINNED = {llama_peer.NAME: f"{llama_peer.SDIST}=={llama_peer.VERSION}",
          vllm_peer.NAME: f"{vllm_peer.PACKAGE}=={vllm_peer.VERSION}"}
SHOWN_ENV = ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS",
             "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "GPUSERV_CPU_ISA")


def _replay_sampled(server: ServerProcess, endpoint: Endpoint, requests: Sequence, warm_prompt):
    """(replay, the server tree's sampler, this client's CPU seconds during the replay)."""
    async def run():
        await warm_up(endpoint, warm_prompt)
        sampler = TreeSampler(server.pid).start()
        client0 = time.process_time()
        try:
            return await replay_async(endpoint, requests), sampler, time.process_time() - client0
        finally:
            sampler.stop()

    return asyncio.run(run())


def run_server(system: str, spec: ServerSpec, endpoint: Endpoint, requests: Sequence, log_path: Path,
               info: dict) -> SystemRun:
    """Start `spec`, replay `requests` through `endpoint`, stop it; one SystemRun named `system`.
    `info` (version, settings) goes into the run's extra beside what was measured."""
    warm_prompt = list(requests[0].prompt_token_ids[:16]) if requests else [100] * 8
    with ServerProcess(spec, log_path) as server:
        rep, sampler, client_cpu_s = _replay_sampled(server, endpoint, requests, warm_prompt)
    check = rep.token_check(requests)
    tokens = sum(t.output_tokens for t in rep.timings)
    env = {k: v for k, v in spec.env.items() if k in SHOWN_ENV}
    extra = {"target": "http", "transport": endpoint.transport, "command": shlex.join(spec.cmd), "env": env,
             "ready_s": server.ready_s, "server_log": str(log_path), "errors": rep.errors,
             "token_check": check, "outputs_exact": check["ok"], **info,
             **sampler.summary(tokens),
             # The client shares the cores with the server: what it took is what the server could not use.
             "client_cpu_ms_per_token": round(1000 * client_cpu_s / tokens, 4) if tokens else None}
    return SystemRun(system, rep.wall_s, rep.timings, extra)


def install_peer(name: str, job: PeerJob, log=print) -> dict:
    """Install `name` for `job` if it is not yet (PeerUnavailable with the reason when that fails)."""
    try:
        return HTTP_PEERS[name].install(job, log)
    except PeerUnavailable:
        raise
    except Exception as exc:  # noqa: BLE001 - any install failure skips the peer with its reason
        raise PeerUnavailable(f"install failed: {type(exc).__name__}: {exc}") from exc


def run_http_peer(name: str, job: PeerJob, requests: Sequence, out_dir: Path, log=print) -> SystemRun:
    """Install (first use), start and measure one HTTP peer; PeerUnavailable when it cannot run here."""
    mod = HTTP_PEERS[name]
    installed = install_peer(name, job, log)
    spec, settings = mod.server_spec(job, installed, free_port())
    endpoint = Endpoint(base_url=spec.base_url, model=job.model_name)
    log(f"{name}: starting {shlex.join(spec.cmd)}")
    try:
        return run_server(name, spec, endpoint, requests, Path(out_dir) / f"{name}.log",
                          {"version": installed["version"], "pinned": PINNED[name], "settings": settings,
                           "dtype": job.dtype, "num_threads": job.threads, "max_num_seqs": job.max_num_seqs,
                           "isa": job.isa})
    except ServerFailed as exc:
        raise PeerUnavailable(f"server did not start: {str(exc).splitlines()[0]}") from exc

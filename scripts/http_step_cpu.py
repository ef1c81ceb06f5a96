#!/usr/bin/env python3
"""Where the daemon's CPU goes per streamed token, against the same burst in-process, rounds interleaved.

One private daemon (this tree, the bench's engine config) and one in-process engine in this process take the
same burst in turn (in-process, HTTP, in-process, HTTP, ...). Per round it prints wall tok/s, and CPU time
per token by thread: for the daemon its event loop (MainThread), its engine thread, the engine's OpenMP
workers and the rest (from /proc/PID/task/TID/schedstat, with their run-queue waits); for both, the engine's
own step record sums (forward, sample, whole step) and the time between steps. CPU time is what a loaded
machine stretches least: compare the per-token CPU columns first, wall tok/s second.

    PYTHONPATH=$PWD .venv/bin/python scripts/http_step_cpu.py [--rounds 3] [--streams 48] [--tokens 128]
        [--config profiles/engine/peers-48.yaml] [--dtype bfloat16] [--no-inprocess] [--hold S]

"between steps" is the engine thread's time from one step's end to the next one's start: ~0.1 ms a step
in-process; in the daemon it is where the engine thread hands a step's outputs to the event loop (see
gpuservd/engine/wakeup.py). The daemon gets a sitecustomize that names its Python threads (comm) and logs
their ids; GPUSERV_SWI=seconds also sets its interpreter switch interval (an experiment knob).
--hold waits after the daemon is up (to attach py-spy: its pid is printed first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

SITE = '''
import ctypes, os, threading
_libc = ctypes.CDLL(None)
_run = threading.Thread.run
def _named_run(self):
    try:
        _libc.prctl(15, ("py-" + self.name)[:15].encode(), 0, 0, 0)
        with open(os.environ["GPUSERV_THREAD_LOG"], "a") as f:
            f.write(f"{os.getpid()} {threading.get_native_id()} {self.name}\\n")
    except Exception:
        pass
    return _run(self)
threading.Thread.run = _named_run
if os.environ.get("GPUSERV_SWI"):
    import sys
    sys.setswitchinterval(float(os.environ["GPUSERV_SWI"]))
'''


def thread_stats(pid: int) -> dict:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            run_ns, wait_ns, _ = map(int, Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split())
        except OSError:
            continue
        out[int(tid)] = (run_ns, wait_ns)
    return out


def classify(pid: int, tid: int, names: dict) -> str:
    if tid == pid:
        return "event loop"
    name = names.get(tid)
    if name is None:
        comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip() if os.path.exists(
            f"/proc/{pid}/task/{tid}/comm") else "?"
        return "omp workers" if comm.startswith("py-engine") else f"other({comm})"
    if name.startswith("engine-"):
        return "engine thread"
    return "encode" if name.startswith("encode") else "other py"


async def recent_steps(client: httpx.AsyncClient, n: int) -> list[dict]:
    """The last n step records, from /admin/events?recent=n (read until the replay ends)."""
    steps = []
    async with client.stream("GET", f"/admin/events?recent={n}&types=step") as resp:
        lines = resp.aiter_lines()
        while True:
            try:
                line = await asyncio.wait_for(lines.__anext__(), 1.0)
            except (asyncio.TimeoutError, StopAsyncIteration):
                break
            d = json.loads(line)
            if d.get("type") == "step":
                steps.append(d)
    return steps[-n:]


def step_summary(steps: list, wall: float, tokens: int) -> str:
    """The engine's own step records: forward, sampling and the rest of a step per token, and the engine
    thread's time between one step's end and the next one's start (delivery, the inbox, waiting for the
    interpreter's lock) per step."""
    steps = sorted(steps, key=lambda s: s["t"])
    fwd = sum(s["forward_s"] for s in steps)
    smp = sum(s["sample_s"] for s in steps)
    whole = sum(s["wall_s"] for s in steps)
    gaps = [max(0.0, (b["t"] - b["wall_s"]) - a["t"]) for a, b in zip(steps, steps[1:])]
    dec = [s["forward_s"] for s in steps if s["num_decode_tokens"] >= 40 and not s["num_prefill_tokens"]]
    head = " ".join(f"{s['num_prefill_tokens']}p{s['num_decode_tokens']}d" for s in steps[:3])
    return (f"[{head} ..] {len(steps)} steps: forward {1000 * fwd / tokens:.3f} sample {1000 * smp / tokens:.3f} "
            f"rest {1000 * (whole - fwd - smp) / tokens:.3f} ms/token; between steps "
            f"{1000 * statistics.mean(gaps) if gaps else 0:.2f} ms/step (p50 "
            f"{1000 * statistics.median(gaps) if gaps else 0:.2f}); decode>=40 forward p50 "
            f"{1000 * statistics.median(dec) if dec else 0:.1f} ms")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=48)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--config", default="profiles/engine/peers-48.yaml")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-inprocess", action="store_true")
    p.add_argument("--hold", type=float, default=0.0, help="seconds to wait after start (to attach py-spy)")
    a = p.parse_args()

    from gpuservd.bench.engine_run import run_gpuserv
    from gpuservd.bench.gpuserv_http import daemon_config, daemon_spec
    from gpuservd.bench.http_client import replay_async, warm_up
    from gpuservd.bench.server_process import ServerProcess
    from gpuservd.bench.socket_run import gpuserv_endpoint
    from gpuservd.bench.workload import WorkloadRequest

    reqs = [WorkloadRequest(f"r{i}", "decode", 0.0, [100 + (i * 7 + j) % 500 for j in range(32)], a.tokens,
                            model="smollm2") for i in range(a.streams)]
    tokens = a.streams * a.tokens
    engine = None
    if not a.no_inprocess:
        from gpuservd.config import load_config
        from gpuservd.engine.engine import LLMEngine
        from gpuservd.runner.omp import use_threads
        cfg = load_config(Path(a.config))
        cfg.model = "smollm2"
        cfg.num_threads = a.threads
        cfg.dtype = a.dtype
        use_threads(a.threads)
        engine = LLMEngine.from_store("smollm2", cfg)
    with tempfile.TemporaryDirectory(prefix="gpuserv-stepcpu-") as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITE)
        thread_log = Path(tmp) / "threads.txt"
        os.environ["GPUSERV_THREAD_LOG"] = str(thread_log)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
        spec = daemon_spec(Path(tmp), "smollm2", daemon_config(Path(a.config), a.threads, a.dtype))
        spec.env["GPUSERV_THREAD_LOG"] = str(thread_log)
        endpoint = gpuserv_endpoint("smollm2", spec.uds)
        endpoint.extra_body = {"return_token_ids": True}
        with ServerProcess(spec, Path(tmp) / "daemon.log") as server:
            pid = server.pid
            print(f"daemon pid {pid}", flush=True)
            time.sleep(a.hold)

            async def http_round():
                await warm_up(endpoint, reqs[0].prompt_token_ids[:16])
                s0 = thread_stats(pid)
                t_start = time.time()
                c0 = time.process_time()
                rep = await replay_async(endpoint, reqs)
                client = time.process_time() - c0
                s1 = thread_stats(pid)
                async with endpoint.client() as c:
                    steps = await recent_steps(c, 4 * a.tokens)
                return rep, client, s0, s1, steps, t_start

            for r in range(a.rounds):
                if engine is not None:
                    load = open("/proc/loadavg").read().split()[:3]
                    c0 = time.process_time()
                    t_start = time.time()
                    run = run_gpuserv(engine, reqs)
                    cpu = time.process_time() - c0
                    steps = [s.to_dict() for s in engine.telemetry.recent()]
                    steps = [s for s in steps if s["t"] - s["wall_s"] >= t_start and not (s["num_prefill_tokens"] <= 32 and s["num_decode_tokens"] <= 2)]
                    print(f"[{r}] in-process {tokens / run.wall_s:7.1f} tok/s  process CPU "
                          f"{1000 * cpu / tokens:.3f} ms/token; {step_summary(steps, run.wall_s, tokens)} "
                          f"(load {' '.join(load)})", flush=True)
                load = open("/proc/loadavg").read().split()[:3]
                rep, client, s0, s1, steps, t_start = asyncio.run(http_round())
                names = {}
                if thread_log.exists():
                    for line in thread_log.read_text().splitlines():
                        p_, t_, n_ = line.split(" ", 2)
                        if int(p_) == pid:
                            names[int(t_)] = n_
                groups: dict[str, list[float]] = {}
                for tid, (run_ns, wait_ns) in s1.items():
                    r0, w0 = s0.get(tid, (0, 0))
                    g = groups.setdefault(classify(pid, tid, names), [0.0, 0.0])
                    g[0] += (run_ns - r0) / 1e6
                    g[1] += (wait_ns - w0) / 1e6
                total = sum(g[0] for g in groups.values())
                steps = [s for s in steps if s["t"] - s["wall_s"] >= t_start]
                print(f"[{r}] http       {tokens / rep.wall_s:7.1f} tok/s  daemon CPU {total / tokens:.3f} "
                      f"ms/token (client {1000 * client / tokens:.3f}); {step_summary(steps, rep.wall_s, tokens)} "
                      f"(load {' '.join(load)})", flush=True)
                print("      " + ", ".join(f"{k} {v[0] / tokens:.3f} (wait {v[1] / tokens:.3f})"
                                          for k, v in sorted(groups.items(), key=lambda kv: -kv[1][0])),
                      flush=True)


if __name__ == "__main__":
    main()

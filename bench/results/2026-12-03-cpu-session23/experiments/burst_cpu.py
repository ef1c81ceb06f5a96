"""The mixed burst through a private daemon (as gpuserv bench's gpuserv[http]), with the daemon's CPU split:
the event loop's thread, the daemon's other threads, the engine worker; per streamed token.
argv[1]: the engine config, argv[2]: repeats (default 1)."""
import asyncio, sys, tempfile, statistics, time
from pathlib import Path
from gpuservd.bench.gpuserv_http import daemon_config, daemon_spec
from gpuservd.bench.server_process import ServerProcess
from gpuservd.bench.socket_run import gpuserv_endpoint
from gpuservd.bench.http_client import replay_async, warm_up
from gpuservd.bench.workload import load_workload
from transformers import AutoTokenizer
wl = load_workload("profiles/workloads/mixed-short-long.yaml")
tok = AutoTokenizer.from_pretrained(str(Path.home() / ".local/share/gpuserv/models/smollm2"))
reqs = wl.materialize(len(tok), [tok.eos_token_id], tokenize=lambda s: tok.encode(s))
cfg = daemon_config(Path(sys.argv[1]), 2, "float32")
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 1
def p99(x):
    x = sorted(x); return x[min(len(x) - 1, int(round(0.99 * (len(x) - 1))))]
with tempfile.TemporaryDirectory() as tmp:
    spec = daemon_spec(Path(tmp), "smollm2", cfg)
    ep = gpuserv_endpoint("smollm2", spec.uds); ep.extra_body = {"return_token_ids": True}
    with ServerProcess(spec, Path(tmp) / "d.log"):
        async def run():
            await warm_up(ep, list(reqs[0].prompt_token_ids[:16]))
            async with ep.client() as c:
                for _ in range(reps):
                    b = (await c.get("/admin/status")).json()["process"]
                    c0 = time.process_time()
                    rep = await replay_async(ep, reqs)
                    cl = time.process_time() - c0
                    a = (await c.get("/admin/status")).json()["process"]
                    tokens = sum(t.output_tokens for t in rep.timings)
                    sh = [t.latency_s for t in rep.timings if t.cls == "short"]; lo = [t.latency_s for t in rep.timings if t.cls == "long"]
                    loop = a["loop_cpu_s"] - b["loop_cpu_s"]; d = a["cpu_s"] - b["cpu_s"]; w = a["workers_cpu_s"] - b["workers_cpu_s"]
                    print(f"{tokens / rep.wall_s:.1f} tok/s wall {rep.wall_s:.2f} short p50 {statistics.median(sh):.2f} p99 {p99(sh):.2f} long p99 {p99(lo):.2f} | ms/token: loop {1e3*loop/tokens:.3f} daemon-other {1e3*(d-loop)/tokens:.3f} worker {1e3*w/tokens:.3f} client {1e3*cl/tokens:.3f}", flush=True)
        asyncio.run(run())

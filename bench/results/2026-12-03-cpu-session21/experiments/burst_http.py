"""The mixed burst through a private daemon (as gpuserv bench's gpuserv[http], no event-stream reader):
tok/s, short and long P99. argv[1]: the engine config, argv[2]: the dtype (float32)."""
import asyncio, sys, tempfile, statistics
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
cfg = daemon_config(Path(sys.argv[1]), 2, sys.argv[2] if len(sys.argv) > 2 else "float32")
with tempfile.TemporaryDirectory() as tmp:
    spec = daemon_spec(Path(tmp), "smollm2", cfg)
    ep = gpuserv_endpoint("smollm2", spec.uds); ep.extra_body = {"return_token_ids": True}
    with ServerProcess(spec, Path(tmp) / "d.log"):
        async def run():
            await warm_up(ep, list(reqs[0].prompt_token_ids[:16]))
            return await replay_async(ep, reqs)
        rep = asyncio.run(run())
def p99(x):
    x = sorted(x); return x[min(len(x) - 1, int(round(0.99 * (len(x) - 1))))]
tokens = sum(t.output_tokens for t in rep.timings)
sh = [t.latency_s for t in rep.timings if t.cls == "short"]; lo = [t.latency_s for t in rep.timings if t.cls == "long"]
print(f"{tokens / rep.wall_s:.1f} tok/s wall {rep.wall_s:.2f} short p50 {statistics.median(sh):.2f} p99 {p99(sh):.2f} long p99 {p99(lo):.2f}")

"""The mixed burst through one private daemon, its own threads (not its engine worker's) alternately at
nice 0 and nice N: does a daemon that yields to the engine's team stall it less at its barriers?
daemon_nice.py CONFIG N ROUNDS"""
import asyncio, os, sys, tempfile
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
nice, rounds = int(sys.argv[2]), int(sys.argv[3])
def set_nice(pid, value):
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), value)
        except OSError:
            pass
with tempfile.TemporaryDirectory() as tmp:
    spec = daemon_spec(Path(tmp), "smollm2", cfg)
    ep = gpuserv_endpoint("smollm2", spec.uds); ep.extra_body = {"return_token_ids": True}
    with ServerProcess(spec, Path(tmp) / "d.log") as sp:
        async def run():
            await warm_up(ep, list(reqs[0].prompt_token_ids[:16]))
            res = {0: [], nice: []}
            for r in range(rounds):
                for value in ((0, nice) if r % 2 == 0 else (nice, 0)):
                    set_nice(sp.proc.pid, value)
                    rep = await replay_async(ep, reqs)
                    tokens = sum(t.output_tokens for t in rep.timings)
                    lat = sorted(t.latency_s for t in rep.timings if t.cls == "short") if hasattr(rep.timings[0], "cls") else []
                    res[value].append(tokens / rep.wall_s)
                    print(f"round {r} nice {value}: {tokens / rep.wall_s:.1f} tok/s", flush=True)
            for value, v in res.items():
                print(f"nice {value}: " + " ".join(f"{x:.1f}" for x in v) + f"  median {sorted(v)[len(v)//2]:.1f}")
        asyncio.run(run())

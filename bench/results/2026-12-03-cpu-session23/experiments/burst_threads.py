"""The mixed burst through a private daemon, with the CPU time of every thread of the daemon and of its engine
worker over the burst (from /proc/PID/task/TID/stat), by thread name: where the serving path's CPU goes."""
import asyncio, os, sys, tempfile, time
from collections import defaultdict
from pathlib import Path
from gpuservd.bench.gpuserv_http import daemon_config, daemon_spec
from gpuservd.bench.server_process import ServerProcess
from gpuservd.bench.socket_run import gpuserv_endpoint
from gpuservd.bench.http_client import replay_async, warm_up
from gpuservd.bench.workload import load_workload
from transformers import AutoTokenizer
TICK = os.sysconf("SC_CLK_TCK")
def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            st = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name = st[st.index("(") + 1:st.rindex(")")]
        f = st[st.rindex(")") + 2:].split()
        out[(int(tid), name)] = (int(f[11]) + int(f[12])) / TICK
    return out
def tree(root):
    pids = [root]
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) == root:
                    pids += tree(int(p))
            except (OSError, IndexError):
                pass
    return pids
wl = load_workload("profiles/workloads/mixed-short-long.yaml")
tok = AutoTokenizer.from_pretrained(str(Path.home() / ".local/share/gpuserv/models/smollm2"))
reqs = wl.materialize(len(tok), [tok.eos_token_id], tokenize=lambda s: tok.encode(s))
cfg = daemon_config(Path(sys.argv[1]), 2, "float32")
with tempfile.TemporaryDirectory() as tmp:
    spec = daemon_spec(Path(tmp), "smollm2", cfg)
    ep = gpuserv_endpoint("smollm2", spec.uds); ep.extra_body = {"return_token_ids": True}
    with ServerProcess(spec, Path(tmp) / "d.log") as sp:
        async def run():
            await warm_up(ep, list(reqs[0].prompt_token_ids[:16]))
            root = sp.proc.pid
            pids = tree(root)
            before = {p: threads(p) for p in pids}
            t0 = time.perf_counter()
            rep = await replay_async(ep, reqs)
            wall = time.perf_counter() - t0
            after = {p: threads(p) for p in pids}
            tokens = sum(t.output_tokens for t in rep.timings)
            print(f"{tokens / rep.wall_s:.1f} tok/s, wall {wall:.2f} s, {tokens} tokens")
            for p in pids:
                comm = open(f"/proc/{p}/comm").read().strip()
                agg = defaultdict(float)
                for key, v in after[p].items():
                    agg[f"{key[1]}:{key[0]}"] += v - before[p].get(key, 0.0)
                tot = sum(agg.values())
                print(f"pid {p} {comm}: {tot:.2f} s CPU ({1e3 * tot / tokens:.3f} ms/token)")
                for name, v in sorted(agg.items(), key=lambda kv: -kv[1]):
                    if v > 0.005:
                        print(f"   {name:20s} {v:7.2f} s  {1e3 * v / tokens:.3f} ms/token")
        asyncio.run(run())

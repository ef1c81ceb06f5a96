"""A fresh private daemon, then the mixed burst N times: tok/s and the engine worker's page faults and CPU
for each burst. Is a fresh daemon's first burst slower, and why? first_burst.py CONFIG N [SLEEP_S]"""
import asyncio, os, sys, tempfile, threading, time
from gpuservd.api.client import Client
from pathlib import Path
from gpuservd.bench.gpuserv_http import daemon_config, daemon_spec
from gpuservd.bench.server_process import ServerProcess
from gpuservd.bench.socket_run import gpuserv_endpoint
from gpuservd.bench.http_client import replay_async, warm_up
from gpuservd.bench.workload import load_workload
from transformers import AutoTokenizer
TICK = os.sysconf("SC_CLK_TCK")
wl = load_workload("profiles/workloads/mixed-short-long.yaml")
tok = AutoTokenizer.from_pretrained(str(Path.home() / ".local/share/gpuserv/models/smollm2"))
reqs = wl.materialize(len(tok), [tok.eos_token_id], tokenize=lambda s: tok.encode(s))
cfg = daemon_config(Path(sys.argv[1]), 2, "float32")
n, pause = int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
def children(pid):
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p))
            except (OSError, IndexError):
                pass
    return out
def stat(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    rss = int(open(f"/proc/{pid}/statm").read().split()[1]) * 4096
    return int(f[7]), int(f[9]), (int(f[11]) + int(f[12])) / TICK, rss  # minflt, majflt, cpu s, rss
with tempfile.TemporaryDirectory() as tmp:
    spec = daemon_spec(Path(tmp), "smollm2", cfg)
    ep = gpuserv_endpoint("smollm2", spec.uds); ep.extra_body = {"return_token_ids": True}
    with ServerProcess(spec, Path(tmp) / "d.log") as sp:
        async def run():
            await warm_up(ep, list(reqs[0].prompt_token_ids[:16]))
            workers = [c for c in children(sp.proc.pid)]
            print("daemon", sp.proc.pid, "children", workers, flush=True)
            events = []
            def reader():
                try:
                    for e in Client(spec.uds).events(types=["step"]):
                        events.append(e)
                except Exception:
                    pass
            threading.Thread(target=reader, daemon=True).start()
            await asyncio.sleep(max(pause, 1.0))
            for i in range(n):
                before = {w: stat(w) for w in workers}
                e0 = len(events)
                rep = await replay_async(ep, reqs)
                tokens = sum(t.output_tokens for t in rep.timings)
                parts = []
                for w in workers:
                    a, b = before[w], stat(w)
                    parts.append(f"pid {w}: minflt {b[0] - a[0]} majflt {b[1] - a[1]} cpu {b[2] - a[2]:.1f} s "
                                 f"({1e3 * (b[2] - a[2]) / tokens:.2f} ms/token) rss {b[3] / 2**20:.0f} MiB")
                print(f"burst {i}: {tokens / rep.wall_s:.1f} tok/s; " + "; ".join(parts), flush=True)
                await asyncio.sleep(0.5)
                st = events[e0:]
                if os.environ.get("STEPS_OUT"):
                    import json; open(os.environ["STEPS_OUT"], "w").write(json.dumps(st))
                fw = sum(e["forward_s"] for e in st); sa = sum(e["sample_s"] for e in st); wa = sum(e["wall_s"] for e in st)
                pf = [e for e in st if e["num_prefill_tokens"]]
                print(f"   {len(st)} steps: wall {wa:.2f} s, forward {fw:.2f}, sample {sa:.2f}, other {wa - fw - sa:.2f};"
                      f" prefill steps {len(pf)} forward {sum(e['forward_s'] for e in pf):.2f} s;"
                      f" decode steps forward {fw - sum(e['forward_s'] for e in pf):.2f} s", flush=True)
        asyncio.run(run())

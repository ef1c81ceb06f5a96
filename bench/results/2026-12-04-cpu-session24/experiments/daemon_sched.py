"""The mixed burst through one private daemon, its own threads (not its engine worker's) alternately under
SCHED_OTHER and SCHED_BATCH (or nice N: MODE=nice10): the worker's time between steps (from the daemon's step
events) and tok/s. One burst first, unmeasured, so that every measured one meets the same prefix cache.
daemon_sched.py CONFIG ROUNDS [MODE]"""
import asyncio, os, sys, tempfile, threading
from pathlib import Path
from gpuservd.api.client import Client
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
rounds = int(sys.argv[2]); mode = sys.argv[3] if len(sys.argv) > 3 else "batch"
def set_policy(pid, on):
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if mode == "batch":
                os.sched_setscheduler(int(tid), os.SCHED_BATCH if on else os.SCHED_OTHER, os.sched_param(0))
            else:
                os.setpriority(os.PRIO_PROCESS, int(tid), int(mode[4:]) if on else 0)
        except OSError:
            pass
def gaps(st):
    g = sorted((b["t"] - b["wall_s"]) - a["t"] for a, b in zip(st, st[1:]))
    return sum(g), g[len(g) // 2], g[9 * len(g) // 10]
with tempfile.TemporaryDirectory() as tmp:
    spec = daemon_spec(Path(tmp), "smollm2", cfg)
    ep = gpuserv_endpoint("smollm2", spec.uds); ep.extra_body = {"return_token_ids": True}
    with ServerProcess(spec, Path(tmp) / "d.log") as sp:
        async def run():
            await warm_up(ep, list(reqs[0].prompt_token_ids[:16]))
            events = []
            def reader():
                try:
                    for e in Client(spec.uds).events(types=["step"]):
                        events.append(e)
                except Exception:
                    pass
            threading.Thread(target=reader, daemon=True).start()
            await asyncio.sleep(1.0)
            await replay_async(ep, reqs)  # the prefix cache's first fill
            res = {False: [], True: []}
            for r in range(rounds):
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    set_policy(sp.proc.pid, on)
                    await asyncio.sleep(0.5)
                    e0 = len(events)
                    rep = await replay_async(ep, reqs)
                    await asyncio.sleep(0.5)
                    tokens = sum(t.output_tokens for t in rep.timings)
                    s, p50, p90 = gaps(events[e0:])
                    res[on].append((tokens / rep.wall_s, s))
                    print(f"round {r} {mode if on else 'other'}: {tokens / rep.wall_s:.1f} tok/s, {len(events) - e0} steps,"
                          f" gaps between steps: sum {s:.3f} s, p50 {1e3 * p50:.2f} ms, p90 {1e3 * p90:.2f} ms", flush=True)
            for on, v in res.items():
                print(f"{mode if on else 'other'}: tok/s " + " ".join(f"{x[0]:.1f}" for x in v) + "; gap sums " + " ".join(f"{x[1]:.3f}" for x in v))
        asyncio.run(run())

"""The mixed burst through a private daemon, then the daemon's own record of it (/admin/events: each request's
arrival and end, each step's time and queue): when did the requests reach the engine against its first steps?"""
import asyncio, json, sys, tempfile, threading, time
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
out = Path(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    spec = daemon_spec(Path(tmp), "smollm2", cfg)
    ep = gpuserv_endpoint("smollm2", spec.uds); ep.extra_body = {"return_token_ids": True}
    with ServerProcess(spec, Path(tmp) / "d.log") as sp:
        events = []
        def reader():
            try:
                for e in Client(spec.uds).events(types=["step", "request_finished"]):
                    events.append(e)
            except Exception as exc:  # the daemon closes the stream at exit
                print("reader:", exc)
        async def run():
            await warm_up(ep, list(reqs[0].prompt_token_ids[:16]))
            threading.Thread(target=reader, daemon=True).start()
            await asyncio.sleep(1.0)
            t0 = time.time()
            rep = await replay_async(ep, reqs)
            await asyncio.sleep(1.0)
            tokens = sum(t.output_tokens for t in rep.timings)
            print(f"{tokens / rep.wall_s:.1f} tok/s, wall {rep.wall_s:.2f} s")
            return t0
        t0 = asyncio.run(run())
        out.write_text(json.dumps({"t0": t0, "events": events}))
        fin = sorted((e for e in events if e["type"] == "request_finished"), key=lambda e: e["arrival_t"])
        steps = [e for e in events if e["type"] == "step"]
        arr = [e["arrival_t"] - t0 for e in fin]
        print(f"{len(fin)} requests reached the daemon {arr[0]*1e3:.1f}..{arr[-1]*1e3:.1f} ms after the client began"
              f" (p50 {arr[len(arr)//2]*1e3:.1f})")
        for s in steps[:6]:
            print(f"step {s['step_id']}: ended {1e3 * (s['t'] - t0):.1f} ms, wall {1e3 * s['wall_s']:.1f} ms, prefill {s['num_prefill_tokens']}"
                  f" decode {s['num_decode_tokens']}, running {s['num_running']} waiting {s['num_waiting']}")

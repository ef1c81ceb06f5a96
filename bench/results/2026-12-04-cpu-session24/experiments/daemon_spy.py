"""The mixed burst through a private daemon with py-spy sampling the daemon's process (not its engine worker):
collapsed stacks of where the daemon's own CPU goes per streamed token. daemon_spy.py CONFIG OUT.txt [DTYPE]
(DTYPE float32 by default; session 25 ran it with bfloat16, and with PYSPY_GIL=1: only samples that hold the
interpreter, at 1000 Hz, instead of every thread at 250 Hz without pausing the process)."""
import asyncio, os, subprocess, sys, tempfile, time
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
SAMPLING = ["--gil", "--rate", "1000"] if os.environ.get("PYSPY_GIL") == "1" else ["--nonblocking", "--rate", "250"]
cfg = daemon_config(Path(sys.argv[1]), 2, sys.argv[3] if len(sys.argv) > 3 else "float32")
with tempfile.TemporaryDirectory() as tmp:
    spec = daemon_spec(Path(tmp), "smollm2", cfg)
    ep = gpuserv_endpoint("smollm2", spec.uds); ep.extra_body = {"return_token_ids": True}
    with ServerProcess(spec, Path(tmp) / "d.log") as sp:
        async def run():
            await warm_up(ep, list(reqs[0].prompt_token_ids[:16]))
            spy = subprocess.Popen(["/tmp/pyspy-t/bin/py-spy", "record", "-p", str(sp.proc.pid), *SAMPLING, "--format", "raw", "-o", sys.argv[2], "-d", "40"],
                                   stdout=subprocess.DEVNULL, stderr=open(sys.argv[2] + ".log", "w"))
            await asyncio.sleep(1.0)
            rep = await replay_async(ep, reqs)
            spy.send_signal(2); spy.wait()
            tokens = sum(t.output_tokens for t in rep.timings)
            print(f"{tokens / rep.wall_s:.1f} tok/s, wall {rep.wall_s:.2f} s, {tokens} tokens")
        asyncio.run(run())

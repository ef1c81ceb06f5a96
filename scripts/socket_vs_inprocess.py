#!/usr/bin/env python3
"""Throughput of a bench workload in-process vs through the daemon's socket (target: socket >= 0.9x).

    scripts/socket_vs_inprocess.py --workload profiles/workloads/smoke.yaml [--config FILE] [--model NAME] [--repeat 3]

Both runs use the same engine config, the same materialized requests (token-id
prompts, forced lengths, greedy, no text) and alternate, best of --repeat each.
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", type=Path, default=ROOT / "profiles" / "workloads" / "smoke.yaml")
    p.add_argument("--config", type=Path)
    p.add_argument("--model")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()

    from gpuservd.bench.socket_run import run_socket
    from gpuservd.bench.engine_run import run_gpuserv
    from gpuservd.bench.workload import load_workload
    from gpuservd.config import load_config
    from gpuservd.engine.engine import LLMEngine

    workload = load_workload(a.workload)
    cfg = load_config(a.config)
    cfg.model = a.model or workload.model
    engine = LLMEngine.from_store(cfg.model, cfg)
    tok = engine.tokenizer
    requests = workload.materialize(len(tok), sorted(engine.eos_token_ids), tokenize=lambda s: tok.encode(s))
    for r in requests:
        r.model = cfg.model

    with tempfile.TemporaryDirectory(prefix="gpuserv-cmp-") as tmp:
        sock = Path(tmp) / "gs.sock"
        cmd = [sys.executable, "-m", "gpuservd.daemon", "--socket", str(sock), "--model", cfg.model,
               "--log-level", "warning"] + (["--config", str(a.config)] if a.config else [])
        proc = None
        results = {"inprocess": [], "socket": []}
        try:
            for i in range(a.repeat):
                run = run_gpuserv(engine, requests)
                results["inprocess"].append(run.generated_tokens / run.wall_s)
                if proc is None:  # the daemon shares the CPUs: start it only once the engine is idle
                    log = open(Path(tmp) / "daemon.log", "wb")
                    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
                    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://d")
                    while True:
                        if proc.poll() is not None:
                            raise SystemExit((Path(tmp) / "daemon.log").read_text()[-2000:])
                        try:
                            if http.get("/ready").status_code == 200:
                                break
                        except httpx.HTTPError:
                            pass
                        time.sleep(0.2)
                gc.collect()
                srun = run_socket(sock, requests, cfg.model)
                assert srun.extra["outputs_exact"], srun.extra
                results["socket"].append(srun.generated_tokens / srun.wall_s)
                print(f"round {i + 1}: in-process {results['inprocess'][-1]:.1f} tok/s, "
                      f"socket {results['socket'][-1]:.1f} tok/s", flush=True)
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    best = {k: max(v) for k, v in results.items()}
    summary = {"workload": workload.name, "model": cfg.model, "requests": len(requests),
               "generated_tokens": sum(r.output_tokens for r in requests), "tok_per_s": results,
               "best_inprocess": round(best["inprocess"], 1), "best_socket": round(best["socket"], 1),
               "ratio": round(best["socket"] / best["inprocess"], 3)}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

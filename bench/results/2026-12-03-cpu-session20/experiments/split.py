import subprocess, sys, json, os, gc
from gpuservd.config import load_config
from gpuservd.engine.engine import LLMEngine
from gpuservd.store.store import ModelStore
from gpuservd.bench.engine_run import run_gpuserv, commit_kv_pool
from gpuservd.bench.workload import load_workload
from gpuservd.runner import cpu_isa
cpu_isa.apply()
cfgp = os.environ.get("CFG", "profiles/engine/peers-48.yaml")
wl = load_workload("profiles/workloads/mixed-short-long.yaml")
def inproc():
    cfg = load_config(cfgp); cfg.model = "smollm2"
    eng = LLMEngine(cfg.model, ModelStore().path(cfg.model), cfg)
    commit_kv_pool(eng)
    tok = eng.tokenizer
    reqs = wl.materialize(len(tok), sorted(eng.eos_token_ids), tokenize=lambda s: tok.encode(s))
    n0 = eng.telemetry.num_steps
    run = run_gpuserv(eng, reqs)
    steps = eng.telemetry.recent()[-(eng.telemetry.num_steps - n0):]
    steps = steps[-run.extra["num_steps"]:]
    tokens = run.generated_tokens
    w = sum(s.wall_s for s in steps); f = sum(s.forward_s for s in steps); sm = sum(s.sample_s for s in steps); d = sum(s.decision_s for s in steps)
    big=[x.forward_s for x in steps if x.num_prefill_tokens>0 or x.num_decode_tokens>8]; tail=[x.forward_s for x in steps if not(x.num_prefill_tokens>0 or x.num_decode_tokens>8)]
    print(f"   INPROC fwd big n={len(big)} {sum(big):.2f} tail n={len(tail)} {sum(tail):.2f}")
    print(f"INPROC {tokens/run.wall_s:6.1f} tok/s wall {run.wall_s:.2f} steps {len(steps)} sum wall {w:.2f} fwd {f:.2f} sample {sm:.2f} decide {d:.2f}", flush=True)
    del eng; gc.collect()
for i in range(int(sys.argv[1])):
    inproc()
    out = subprocess.run([sys.executable, "/tmp/s20/http_steps.py", "0", cfgp], capture_output=True, text=True, env=os.environ).stdout
    print("HTTP  ", [l for l in out.splitlines() if "settle" in l][0][13:90], flush=True)
    [print("      ", l, flush=True) for l in out.splitlines() if "SPLIT" in l]

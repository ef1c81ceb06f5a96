"""Median decode-step time of SmolLM2 (the store's, engine.dtype auto) at 1/8/24/48 running sequences, contexts
~32+ tokens (and 8 x ~500 for the long tail): LLMEngine.step() wall, after warm-up. Run from a tree:
    PYTHONPATH=$TREE python steps.py OUT.json"""
import json, random, statistics, sys, time
from pathlib import Path
import torch
from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams

md = Path.home() / ".local/share/gpuserv/models/smollm2"
cfg = EngineConfig(model="smollm2")
cfg.scheduler.max_num_seqs = 64
eng = LLMEngine("smollm2", md, cfg)
res = {"torch_threads": torch.get_num_threads()}
CASES = ((1, 32, 40), (8, 32, 20), (24, 32, 16), (48, 32, 16), (8, 480, 16))
import os
if os.environ.get("QUICK"):
    CASES = ((2, 32, 2), (2, 100, 8))
for nb, prompt, warm in CASES:
    random.seed(nb)
    ids = [f"r{nb}-{prompt}-{i}" for i in range(nb)]
    for rid in ids:
        eng.add_request(rid, [random.randrange(1000, 20000) for _ in range(prompt)],
                        SamplingParams(max_tokens=warm + 30, ignore_eos=True, temperature=0.0))
    for _ in range(warm):
        eng.step()
    ts = []
    for _ in range(20):
        t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
    for rid in ids:
        if rid in eng.requests:
            eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    res[f"b{nb}_ctx{prompt}_ms"] = round(1e3 * statistics.median(ts), 2)
    print(nb, prompt, res[f"b{nb}_ctx{prompt}_ms"], flush=True)
Path(sys.argv[1]).write_text(json.dumps(res, indent=1) + "\n")

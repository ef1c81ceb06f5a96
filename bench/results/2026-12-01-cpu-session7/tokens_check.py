"""Greedy tokens of a bench workload on the in-process engine: a digest to compare two trees.

Run from a tree's root: PYTHONPATH=$PWD python /work/wt/tokens_check.py WORKLOAD [N]
"""
import hashlib, sys, time
from gpuservd.bench.workload import load_workload
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams

wl = load_workload(sys.argv[1])
n = int(sys.argv[2]) if len(sys.argv) > 2 else 24
engine = LLMEngine.from_store(wl.model)
reqs = wl.materialize(engine.tokenizer.vocab_size if hasattr(engine.tokenizer, "vocab_size") else 49152,
                      engine.tokenizer.eos_token_id)[:n]
t0 = time.perf_counter()
outs = engine.generate([r.prompt_token_ids for r in reqs],
                       SamplingParams(max_tokens=min(64, max(r.output_tokens for r in reqs)), temperature=0.0,
                                      ignore_eos=True, detokenize=False))
h = hashlib.sha256(repr(outs).encode()).hexdigest()[:16]
print(f"{wl.name}: {len(outs)} requests, {sum(map(len, outs))} tokens, digest {h}, {time.perf_counter()-t0:.1f}s")
print("first:", outs[0][:16])

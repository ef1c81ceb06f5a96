"""Where a decode step's time goes: each section timed with perf_counter around its (synchronous) CPU call.

torch.profiler on a 2-core VM books OpenMP wake-ups to whichever op runs next; wall time around each call
does not. The engine steps SmolLM2 (from the store) with N sequences of a C-token prompt, greedy or with a
temperature; after the prompts are in, STEPS decode steps are timed, the whole step and per section: the
linear layers (qkv, o_proj, gate_up, down), attention (runner.attention.paged_attention), the fused
elementwise ops (rms_norm, add_rms_norm_, rope_store_kv, silu_mul), the final norm + LM head, the batch
build and the engine's sampling and hand-out (_update); "glue" is the forward's time outside all of them
(Python per layer, views, dispatch). Also the minor page faults per step (first writes into the lazily
zeroed KV pool). The wrappers add ~1 us a call, so sections are upper bounds; take ratios, not sums.

    PYTHONPATH=. .venv/bin/python scripts/profile_decode_step.py --cases 8x480,1x480,8x32,1x32 [--temperature 0.8]
"""

from __future__ import annotations

import argparse
import collections
import random
import resource
import statistics
import time

from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.paths import models_root
from gpuservd.runner import attention, llama
from gpuservd.runner import model_runner as mr

TOTALS: dict[str, float] = collections.defaultdict(float)


def timed(fn, key: str):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TOTALS[key] += time.perf_counter() - t
    return wrapper


class TimedOps:
    """The fused-op namespace with every call timed under its own name."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return timed(getattr(self._ops, name), name)


def instrument(eng: LLMEngine) -> None:
    model = eng.runner.model
    if model._ops is not None:
        model._ops = TimedOps(model._ops)
    llama.paged_attention = timed(attention.paged_attention, "attention")
    for i in range(model.arch.num_layers):
        lw = model.weights.layer(i)
        for name in ("qkv", "o_proj", "gate_up", "down"):
            setattr(lw, name, timed(getattr(lw, name), "linear:" + name))
    model.logits = timed(model.logits, "final norm + lm_head")
    model.forward = timed(model.forward, "forward")
    eng._update = timed(eng._update, "engine._update (sampling, hand-out)")
    mr.build_batch = timed(mr.build_batch, "build_batch")


def run_case(eng: LLMEngine, nb: int, prompt: int, temperature: float, steps: int) -> None:
    random.seed(nb * 1000 + prompt)
    ids = [f"p{nb}-{prompt}-{i}" for i in range(nb)]
    for rid in ids:
        eng.add_request(rid, [random.randrange(1000, 20000) for _ in range(prompt)],
                        SamplingParams(max_tokens=steps + 40, ignore_eos=True, temperature=temperature))
    for _ in range(8 + nb * prompt // 128):  # the prompts (chunked prefill) and a few decode steps
        eng.step()
    TOTALS.clear()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
    for rid in ids:
        if rid in eng.requests:
            eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    inner = sum(v for k, v in TOTALS.items() if k not in ("forward", "engine._update (sampling, hand-out)",
                                                          "build_batch"))
    TOTALS["glue (forward minus sections)"] = TOTALS["forward"] - inner
    print(f"== {nb} x {prompt} tokens, temperature {temperature}: step median {1e3 * statistics.median(ts):.2f} ms, "
          f"{faults:.0f} minor faults a step")
    for k, v in sorted(TOTALS.items(), key=lambda kv: -kv[1]):
        print(f"   {k:38s} {1e3 * v / steps:8.3f} ms/step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="8x480,1x480,8x32,1x32", help="NxC,...: N sequences of C prompt tokens")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()
    cfg = EngineConfig(model=args.model)
    cfg.scheduler.max_num_seqs = 64
    eng = LLMEngine(args.model, models_root() / args.model, cfg)
    instrument(eng)
    for case in args.cases.split(","):
        nb, prompt = map(int, case.split("x"))
        run_case(eng, nb, prompt, args.temperature, args.steps)


if __name__ == "__main__":
    main()

"""Where a decode step's time goes: each section timed with perf_counter around its (synchronous) CPU call.

torch.profiler on a 2-core VM books OpenMP wake-ups to whichever op runs next; wall time around each call
does not. The engine steps SmolLM2 (from the store) with N sequences of a C-token prompt, greedy or with a
temperature; after the prompts are in, STEPS decode steps are timed, the whole step and per section: the
linear layers (qkv, o_proj, gate_up, down), attention (runner.attention.paged_attention), the fused
elementwise ops (rms_norm, add_rms_norm_, rope_store_kv, silu_mul), the final norm + LM head, the batch
build and the engine's sampling and hand-out (_update); "glue" is the forward's time outside all of them
(Python per layer, views, dispatch). Also the minor page faults per step, and with --faults per section
(first writes into the lazily zeroed KV pool land in rope_store_kv). The wrappers add ~1-2 us a call
(more with --faults), so sections are upper bounds; take ratios, not sums. Timing inside the layers runs
them in the per-layer loop; --stack runs them as the engine does (one decoder_stack op a forward, no
interpreter between the ops) and times the step and its outer sections only.

Per call, each section gives its wall p50 and min and the calling thread's CPU time (p50, min). On a
shared machine a 2-thread team waits at every barrier for a thread that is off its core, so wall times
there measure the load; with --threads 1 the CPU time is the call's own work (cache traffic of other jobs
still counts), and the mins say what a quiet machine would give. --isolated REPS then runs each linear
on the last step's input outside the step, on one layer's weight back to back ("hot": in cache) and on
the layers' weights in turn ("cold": as a step meets them), to tell cache effects from the step's own.

--mixed D+P/K,... times a step of a burst's short phase: D decode rows at 64 tokens of context beside
P prompt tokens in K prefill chunks from position 0 (e.g. 40+256/6), run through the model runner on made-up
block tables (no engine, no sampling: the forward and its sections only).

    PYTHONPATH=. .venv/bin/python scripts/profile_decode_step.py --cases 8x480,1x480,8x32,1x32 [--temperature 0.8]
    ... --cases 48x64,8x480 --steps 20 --dtype float32 --isa avx2 [--threads 1 --isolated 3]
    ... --cases none --mixed 40+256/6,16+256/8 --steps 20
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import resource
import statistics
import time

import torch

from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.paths import models_root
from gpuservd.runner import attention, cpu_isa, llama
from gpuservd.runner import model_runner as mr
from gpuservd.runner.batch import SeqChunk

CALLS: dict[str, list[float]] = collections.defaultdict(list)  # every call's seconds, per section
# every call's CPU seconds on the calling thread: with --threads 1 the call's own work, which a shared
# machine's other jobs do not stretch (time off the core is not counted; their cache traffic still is)
CPU: dict[str, list[float]] = collections.defaultdict(list)
FAULTS: dict[str, int] = collections.defaultdict(int)  # minor page faults inside each section's calls
# Count faults per section (--faults): two getrusage calls around every call, which lengthen the step and
# its glue (RUSAGE_SELF sums over the process's threads), so off unless asked.
COUNT_FAULTS = False


def minflt() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


INPUTS: dict[str, torch.Tensor] = {}  # the last input each linear kind saw (the isolated calls reuse it)


def timed(fn, key: str, keep_input: bool = False):
    def wrapper(*a, **k):
        if keep_input:
            INPUTS[key] = a[0]
        f = minflt() if COUNT_FAULTS else 0
        c, t = time.thread_time(), time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt, dc = time.perf_counter() - t, time.thread_time() - c
            CALLS[key].append(dt)
            CPU[key].append(dc)
            if COUNT_FAULTS:
                FAULTS[key] += minflt() - f
    wrapper.inner = fn
    return wrapper


class TimedOps:
    """The fused-op namespace with every call timed under its own name."""

    def __init__(self, ops):
        self._ops = ops

    def __getattr__(self, name):
        return timed(getattr(self._ops, name), name)


def instrument(eng: LLMEngine, layers: bool = True) -> None:
    """layers: time the sections inside the layers, which runs them in the per-layer loop; else the layers
    run as the engine runs them (in one decoder_stack op where it can) and only the outer sections are timed."""
    model = eng.runner.model
    if layers:
        model.stack_enabled = False
        if model._ops is not None:
            model._ops = TimedOps(model._ops)
        llama.paged_attention = timed(attention.paged_attention, "attention")
        for i in range(model.arch.num_layers):
            lw = model.weights.layer(i)
            for name in ("qkv", "o_proj", "gate_up", "down"):
                setattr(lw, name, timed(getattr(lw, name), "linear:" + name, keep_input=True))
    model.logits = timed(model.logits, "final norm + lm_head")
    model.forward = timed(model.forward, "forward")
    eng._update = timed(eng._update, "engine._update (sampling, hand-out)")
    mr.build_batch = timed(mr.build_batch, "build_batch")


def timed_steps(step, steps: int) -> tuple[list[float], float, float]:
    """Run step() `steps` times with the section records cleared first: each call's seconds, then the
    process CPU seconds (every thread's, the team's spinning included) and minor faults per call."""
    CALLS.clear()
    CPU.clear()
    FAULTS.clear()
    f0, cpu0 = minflt(), time.process_time()
    ts = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    return ts, (time.process_time() - cpu0) / steps, (minflt() - f0) / steps


def run_case(eng: LLMEngine, nb: int, prompt: int, temperature: float, steps: int) -> None:
    random.seed(nb * 1000 + prompt)
    ids = [f"p{nb}-{prompt}-{i}" for i in range(nb)]
    for rid in ids:
        eng.add_request(rid, [random.randrange(1000, 20000) for _ in range(prompt)],
                        SamplingParams(max_tokens=steps + 40, ignore_eos=True, temperature=temperature))
    for _ in range(8 + nb * prompt // 128):  # the prompts (chunked prefill) and a few decode steps
        eng.step()
    ts, cpu, faults = timed_steps(eng.step, steps)
    for rid in ids:
        if rid in eng.requests:
            eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    report(f"{nb} x {prompt} tokens, temperature {temperature}", ts, cpu, faults, steps)


def mixed_chunks(dec: int, pf: int, k: int, block_size: int, ctx: int = 64) -> list[SeqChunk]:
    """dec decode rows at ctx tokens of context, then pf prompt tokens in k chunks from position 0, each
    sequence on blocks of its own (the KV they write and read is made up: only the timing counts)."""
    random.seed(dec * 1000 + pf)
    chunks, nxt = [], 0

    def blocks(n_tokens: int) -> list[int]:
        nonlocal nxt
        n = -(-n_tokens // block_size)
        nxt += n
        return list(range(nxt - n, nxt))

    for _ in range(dec):
        chunks.append(SeqChunk([random.randrange(1000, 20000)], ctx - 1, blocks(ctx), sample=True))
    for j in range(k):
        n = pf // k + (1 if j < pf % k else 0)
        chunks.append(SeqChunk([random.randrange(1000, 20000) for _ in range(n)], 0, blocks(n), sample=True))
    return chunks


def run_mixed(eng: LLMEngine, dec: int, pf: int, k: int, steps: int) -> None:
    runner = eng.runner
    chunks = mixed_chunks(dec, pf, k, runner.block_size)
    for _ in range(3):
        runner.execute(chunks)
    ts, cpu, faults = timed_steps(lambda: runner.execute(chunks), steps)
    report(f"{dec} decode rows + {pf} prompt tokens in {k} chunks", ts, cpu, faults, steps)


def report(title: str, ts: list[float], cpu: float, faults: float, steps: int) -> None:
    totals = {k: sum(v) for k, v in CALLS.items()}
    outer = ("forward", "engine._update (sampling, hand-out)", "build_batch")
    totals["glue (forward minus sections)"] = totals["forward"] - sum(v for k, v in totals.items() if k not in outer)
    glue_cpu = (sum(CPU["forward"]) - sum(sum(v) for k, v in CPU.items() if k not in outer)) / steps
    print(f"== {title}: step median {1e3 * statistics.median(ts):.2f} ms, "
          f"min {1e3 * min(ts):.2f} ms, process CPU {1e3 * cpu:.1f} ms a step, {faults:.0f} minor faults a step, "
          f"glue {1e3 * glue_cpu:.2f} ms CPU a step")
    print(f"   {'section':38s} {'ms/step':>8s} {'calls':>6s} {'p50 us':>8s} {'min us':>8s} {'cpu p50':>8s} "
          f"{'cpu min':>8s}" + (f" {'faults':>7s}" if COUNT_FAULTS else "") + "  (per call; cpu: the calling thread's)")
    for k, v in sorted(totals.items(), key=lambda kv: -kv[1]):
        c, cpu = CALLS.get(k), CPU.get(k)
        per = (f"{len(c) / steps:6.0f} {1e6 * statistics.median(c):8.1f} {1e6 * min(c):8.1f} "
               f"{1e6 * statistics.median(cpu):8.1f} {1e6 * min(cpu):8.1f} " + (f" {FAULTS[k] / steps:7.0f}" if COUNT_FAULTS else "") if c else "")
        print(f"   {k:38s} {1e3 * v / steps:8.3f} {per}")


def isolated(eng: LLMEngine, reps: int) -> None:
    """Each linear kind on the last step's input, outside the step: `hot` = layer 0's weight `reps` times
    back to back (the weight stays in cache), `cold` = the layers' weights in turn, as a step meets them but
    with nothing between the calls. Per call, p50 and min; compare with the in-step lines above."""
    model = eng.runner.model
    with torch.inference_mode():
        for name in ("qkv", "o_proj", "gate_up", "down"):
            x = INPUTS.get("linear:" + name)
            if x is None:
                continue
            layers = [model.weights.layer(i) for i in range(model.arch.num_layers)]
            fns = [getattr(lw, name).inner for lw in layers]  # the unwrapped linears
            hot, cold = ([], []), ([], [])
            for _ in range(reps):
                for f in fns:
                    c, t = time.thread_time(), time.perf_counter()
                    f(x)
                    cold[0].append(time.perf_counter() - t), cold[1].append(time.thread_time() - c)
                for _ in fns:
                    c, t = time.thread_time(), time.perf_counter()
                    fns[0](x)
                    hot[0].append(time.perf_counter() - t), hot[1].append(time.thread_time() - c)
            line = " | ".join(f"{label} p50 {1e6 * statistics.median(w):8.1f} min {1e6 * min(w):8.1f} "
                              f"cpu p50 {1e6 * statistics.median(u):8.1f} min {1e6 * min(u):8.1f}"
                              for label, (w, u) in (("hot", hot), ("cold", cold)))
            print(f"   isolated linear:{name:9s} rows {x.shape[0]:3d}: {line} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="8x480,1x480,8x32,1x32", help="NxC,...: N sequences of C prompt tokens")
    ap.add_argument("--mixed", default="", help="D+P/K,...: D decode rows beside P prompt tokens in K chunks")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto", help="engine.dtype: auto (the CPU's default), float32, bfloat16")
    ap.add_argument("--isolated", type=int, default=0, metavar="REPS",
                    help="then time each linear outside the step, REPS passes over the layers (see isolated())")
    ap.add_argument("--faults", action="store_true", help="count page faults per section (costs two syscalls a call)")
    ap.add_argument("--threads", type=int, help="engine.num_threads (default: torch's, the machine's cores)")
    ap.add_argument("--isa", choices=cpu_isa.CHOICES, help="GPUSERV_CPU_ISA for this run (avx2: the AVX2 kernels)")
    ap.add_argument("--stack", action="store_true",
                    help="run the layers as the engine does (one decoder_stack op) and time only the outer sections")
    args = ap.parse_args()
    global COUNT_FAULTS
    COUNT_FAULTS = args.faults
    if args.isa:
        os.environ[cpu_isa.ENV] = args.isa
    isa = cpu_isa.apply()  # before the first tensor op: the libraries read it then
    cfg = EngineConfig(model=args.model, dtype=args.dtype, num_threads=args.threads)
    cfg.scheduler.max_num_seqs = 64
    eng = LLMEngine(args.model, models_root() / args.model, cfg)
    instrument(eng, layers=not args.stack)
    print(f"dtype {cfg.dtype}, ISA {isa}, {eng.runner.model.kernels or 'torch'} kernels, "
          f"{torch.get_num_threads()} threads, layers {'in one op' if args.stack else 'in the timed loop'}")
    for case in args.cases.split(",") if args.cases != "none" else []:
        nb, prompt = map(int, case.split("x"))
        run_case(eng, nb, prompt, args.temperature, args.steps)
        if args.isolated:
            isolated(eng, args.isolated)
    for case in filter(None, args.mixed.split(",")):
        dec, rest = case.split("+")
        pf, k = rest.split("/")
        run_mixed(eng, int(dec), int(pf), int(k), args.steps)
        if args.isolated:
            isolated(eng, args.isolated)


if __name__ == "__main__":
    main()

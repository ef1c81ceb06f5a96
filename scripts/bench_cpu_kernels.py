"""Same-process A/B of the C++ CPU kernels against the torch paths they replace.

1. Decode attention: `ops.paged_decode` (blocks read in place) against
   `decode_attention_torch` (gather + SDPA), SmolLM2's shape (9 heads, 3 KV
   heads, head dim 64, 16-token blocks), fp32, over several batch sizes and
   context lengths. Each layer has its own cache, as in the model, and calls
   cycle over the layers so a case's KV does not sit in the L3 cache unless
   the model's would. Kernel and torch calls alternate; medians are reported,
   as wall time with 2 threads and as process CPU time with 1 thread (the
   latter hardly moves when other jobs share the machine).
2. Whole decode steps of SmolLM2 through ModelRunner.execute with the kernels
   on and off (off = the attention gather path and the torch layer ops),
   alternating blocks of steps, medians per step.

`--baseline REV` adds a third column to the attention cases: paged_decode as it
was at git revision REV (its paged_attention.cpp built beside the current one
under another op namespace), alternated with the current kernel in the same
process, for a before/after of a kernel change. `--attention-cases 8x480,48x64` runs only those batch x
context cases (a batch's lengths spread over the last 13 tokens).

Run under `nice -n 19`; the machine may be shared, so only same-process
ratios mean much. Writes result.json and result.md to --out.

    .venv/bin/python scripts/bench_cpu_kernels.py --out bench/results/2026-11-29-cpu-paged-attention
    .venv/bin/python scripts/bench_cpu_kernels.py --render bench/results/2026-11-29-cpu-paged-attention
        (rewrites result.md from result.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from gpuservd.paths import models_root
from gpuservd.runner import cpu_kernels
from gpuservd.runner.attention import decode_attention_torch
from gpuservd.runner.batch import SeqChunk, build_batch
from gpuservd.runner.model_runner import ModelRunner

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
LAYERS_MAX = 30
CACHE_BYTES_MAX = 1 << 30  # per case, over all its layers


def kernel_at_revision(rev: str, source: str, namespace: str):
    """The kernel file `source` (with the headers beside it) as of git revision `rev`, built with the runner's flags under
    the op namespace `namespace` (so it loads beside today's kernels); returns torch.ops.<namespace>."""
    from torch.utils.cpp_extension import load  # only here: the bench's other cases need no compiler

    root = Path(__file__).resolve().parent.parent
    rel = cpu_kernels.CSRC.relative_to(root)
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    build = Path(os.environ.get("TMPDIR", "/tmp")) / f"{namespace}_{sha}"
    build.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run(["git", "-C", str(root), "ls-tree", "--name-only", f"{sha}:{rel}"], check=True,
                            capture_output=True, text=True).stdout.split()
    for name in [source] + [n for n in listed if n.endswith(".h")]:  # the headers it may include
        text = subprocess.run(["git", "-C", str(root), "show", f"{sha}:{rel}/{name}"], check=True,
                              capture_output=True, text=True).stdout
        for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
            text = text.replace(f"{macro}(gpuserv,", f"{macro}({namespace},")
        (build / name).write_text(text)
    load(name=f"{namespace}_{sha}", sources=[str(build / source)], extra_cflags=cpu_kernels._cflags(),
         extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace)


def baseline_ops(rev: str):
    """paged_decode as of git revision `rev`, under the op namespace gpuserv_base."""
    return kernel_at_revision(rev, "paged_attention.cpp", "gpuserv_base")


def attention_case(batch: int, lens: list[int], reps: int, threads: int, seed: int = 0, base=None,
                   dtype: torch.dtype = torch.float32) -> dict:
    ops = cpu_kernels.get()
    torch.set_num_threads(threads)
    clock = time.perf_counter if threads > 1 else time.process_time
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(need)
    elem = torch.finfo(dtype).bits // 8
    per_layer = 2 * num_blocks * BLOCK * KV_HEADS * HEAD_DIM * elem
    layers = max(2, min(LAYERS_MAX, CACHE_BYTES_MAX // per_layer))
    caches = [(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype),
               torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)) for _ in range(layers)]
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks, as after a while of serving
    chunks, at = [], 0
    for n, nb in zip(lens, need):
        chunks.append(SeqChunk([0], n - 1, perm[at: at + nb], True))
        at += nb
    fb = build_batch(chunks, BLOCK, torch.device("cpu"))
    q = torch.randn(batch, HEADS + KV_HEADS, HEAD_DIM, generator=g).to(dtype)[:, :HEADS]
    scale = HEAD_DIM ** -0.5

    def kernel(layer):
        k, v = caches[layer]
        return ops.paged_decode(q, k, v, fb.decode_block_table, fb.decode_ctx_lens, scale)

    def gather(layer):
        k, v = caches[layer]
        return decode_attention_torch(q, k, v, fb, scale)

    def baseline(layer):
        k, v = caches[layer]
        return base.paged_decode(q, k, v, fb.decode_block_table, fb.decode_ctx_lens, scale)

    # bf16 / fp16: the kernel accumulates in fp32 and rounds once, SDPA differently (test_paged_attention's bounds)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=0)
    torch.testing.assert_close(kernel(0).float(), gather(0).float(), **tol)
    fns = [("kernel", kernel), ("gather", gather)] + ([("baseline", baseline)] if base is not None else [])
    times = {name: [] for name, _ in fns}
    with torch.inference_mode():
        for _ in range(2):  # warm-up
            kernel(0), gather(0)
        for r in range(reps):
            for name, fn in (fns if r % 2 == 0 else fns[::-1]):
                t0 = clock()
                for layer in range(layers):
                    fn(layer)
                times[name].append((clock() - t0) / layers)
    k_us = statistics.median(times["kernel"]) * 1e6
    g_us = statistics.median(times["gather"]) * 1e6
    out = {"batch": batch, "ctx_lens": lens if len(set(lens)) > 1 else lens[0], "dtype": str(dtype).removeprefix("torch."),
           "layers_cycled": layers,
           "threads": threads, "clock": "wall" if threads > 1 else "process_cpu",
           "reps": reps, "kernel_us": round(k_us, 1), "gather_us": round(g_us, 1), "speedup": round(g_us / k_us, 2),
           # The floor: every K and V byte of the batch read once per call, at the rate this call achieved.
           "kv_bytes": sum(lens) * KV_HEADS * HEAD_DIM * 2 * elem,
           "kernel_gb_s": round(sum(lens) * KV_HEADS * HEAD_DIM * 2 * elem / k_us / 1e3, 2)}
    if base is not None:
        b_us = statistics.median(times["baseline"]) * 1e6
        out.update(baseline_us=round(b_us, 1), vs_baseline=round(b_us / k_us, 2))
    return out


def _set_kernels(runner: ModelRunner, ops, on: bool):
    runner.model._ops = ops if on else None
    cpu_kernels._state["ops"] = ops if on else None  # attention asks cpu_kernels.get()


def ab_decode_steps(runner: ModelRunner, batch: int, ctx: int, steps: int, rounds: int, threads: int,
                    modes: dict) -> dict[str, list[float]]:
    """Decode steps of `batch` sequences at context `ctx` under two modes, alternating blocks of
    `steps` steps (ABBA order, `rounds` blocks each after one warm-up block). modes: name -> a
    function that switches the runner to it; the first mode is switched back to at the end.
    Returns each mode's step times in seconds (wall with 2+ threads, process CPU time with 1)."""
    torch.set_num_threads(threads)
    clock = time.perf_counter if threads > 1 else time.process_time
    a, b = modes
    tables = [runner.cache.pool.allocate(-(-(ctx + steps * (rounds * 2 + 1) + 8) // BLOCK)) for _ in range(batch)]
    prompt = [(11 + 7 * i) % 4000 + 3 for i in range(ctx)]
    for t in tables:
        runner.execute([SeqChunk(prompt, 0, t, True)])
    pos = [ctx] * batch
    times = {a: [], b: []}
    try:
        for r in range(rounds * 2 + 1):
            mode = (a, b)[r % 2] if r % 4 < 2 else (b, a)[r % 2]
            modes[mode]()
            for s in range(steps):
                chunks = [SeqChunk([5], pos[i], tables[i], True) for i in range(batch)]
                t0 = clock()
                runner.execute(chunks)
                if r > 0:  # round 0 warms up
                    times[mode].append(clock() - t0)
                pos = [p + 1 for p in pos]
    finally:
        modes[a]()
        for t in tables:
            runner.cache.pool.free(t)
    return times


def step_case(runner: ModelRunner, batch: int, ctx: int, steps: int, rounds: int, threads: int) -> dict:
    ops = cpu_kernels.get()
    times = ab_decode_steps(runner, batch, ctx, steps, rounds, threads,
                            {"kernels": lambda: _set_kernels(runner, ops, True),
                             "torch": lambda: _set_kernels(runner, ops, False)})
    k_ms = statistics.median(times["kernels"]) * 1e3
    t_ms = statistics.median(times["torch"]) * 1e3
    return {"batch": batch, "ctx": ctx, "threads": threads, "clock": "wall" if threads > 1 else "process_cpu",
            "steps_each": len(times["kernels"]), "kernels_ms": round(k_ms, 2),
            "torch_ms": round(t_ms, 2), "speedup": round(t_ms / k_ms, 2)}


def bench_command_line(doc: str, reps: int, render, extra=None) -> argparse.Namespace | None:
    """The A/B scripts' shared command line: --out DIR, --render DIR (rewrites DIR/result.md from
    DIR/result.json with render(result) and returns None), --reps, --model, --quick, and what
    extra(parser) adds. Also checks that the C++ kernels load (exits if not)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, help="where to write result.json and result.md")
    ap.add_argument("--render", type=Path, help="only rewrite DIR/result.md from DIR/result.json")
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--quick", action="store_true", help="fewer cases and repetitions (a smoke run)")
    ap.add_argument("--baseline", metavar="REV", help="also time paged_decode as of this git revision (A/B)")
    ap.add_argument("--attention-only", action="store_true", help="skip the whole-step cases")
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    if args.render:
        (args.render / "result.md").write_text(render(json.loads((args.render / "result.json").read_text())))
        return None
    if not args.out:
        ap.error("--out or --render is required")
    status = cpu_kernels.status()
    if not status["loaded"]:
        raise SystemExit(f"the C++ kernels did not load: {status['reason']}")
    return args


def main():
    def extra(ap):
        ap.add_argument("--attention-cases", metavar="BxCTX,...",
                        help="only these attention cases (e.g. 8x480,48x64), 2 and 1 threads")
        ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="the attention cases' dtype (q and the cache)")
        ap.add_argument("--threads", default="2,1", help="thread counts of the attention cases (e.g. 1)")

    args = bench_command_line(__doc__, 20, render_md, extra=extra)
    if args is None:
        return
    torch.set_num_threads(2)
    status = cpu_kernels.status()

    base = baseline_ops(args.baseline) if args.baseline else None
    attn = []
    ctxs = [128, 512, 2048] if args.quick else [50, 128, 300, 512, 600, 1024, 2048, 4096]
    mixed = [64, 100, 200, 333, 512, 900, 1500, 2048]  # one batch of very different lengths
    only = [tuple(int(x) for x in c.split("x")) for c in args.attention_cases.split(",")] if args.attention_cases else None
    dtype = getattr(torch, args.dtype)
    for threads in (int(t) for t in args.threads.split(",")):
        if only:
            for batch, ctx in only:  # lengths ctx - 12 .. ctx, as a batch's sequences differ
                attn.append(attention_case(batch, [ctx - (i * 7) % 13 for i in range(batch)], args.reps, threads,
                                           base=base, dtype=dtype))
                print(json.dumps(attn[-1]), flush=True)
            continue
        for batch in (1, 8, 32):
            for ctx in ctxs:
                if batch * ctx > 32 * 2048:
                    continue
                attn.append(attention_case(batch, [ctx] * batch, args.reps, threads, base=base, dtype=dtype))
                print(json.dumps(attn[-1]), flush=True)
        attn.append(attention_case(len(mixed), mixed, args.reps, threads, base=base, dtype=dtype))
        print(json.dumps(attn[-1]), flush=True)
    torch.set_num_threads(2)

    steps = []
    model_dir = models_root() / args.model
    if (model_dir / "config.json").exists() and not args.attention_only:
        runner = ModelRunner(model_dir, "float32", "cpu", BLOCK, 512 << 20, 4 << 30, 0.5, 8192)
        cases = [(1, 64), (1, 1024), (8, 512)] if args.quick else [(1, 64), (1, 1024), (1, 2048), (8, 128), (8, 1024), (32, 256)]
        for threads in (2, 1):
            for batch, ctx in cases:
                steps.append(step_case(runner, batch, ctx, steps=4 if args.quick else 8,
                                       rounds=3 if args.quick else 5, threads=threads))
                print(json.dumps(steps[-1]), flush=True)

    result = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other jobs",
        "torch": torch.__version__,
        "baseline": args.baseline,
        "kernel_build": status,
        "attention": {"shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK,
                                "dtype": args.dtype}, "per_layer_call": attn},
        "decode_step": {"model": args.model, "dtype": "float32", "cases": steps},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "result.md").write_text(render_md(result))


NOTES = """Notes: kernels = `paged_decode` (no gather copy) plus the fused layer ops; torch = the gather +
SDPA decode path and the torch layer ops, in the same process. The machine (2 cores) was shared with
other jobs while this ran, load average 3-4: two-thread wall times then depend on when the OS runs our
second thread, and swing by 2x or more between neighbouring cases (a parallel region waits for its slowest
thread). The one-thread rows use process CPU time, which descheduling does not inflate; read those for the
ratio. Attention cases cycle over separate per-layer caches, so KV comes from DRAM as in a model step."""


def render_md(result: dict) -> str:
    attn, steps = result["attention"]["per_layer_call"], result["decode_step"]["cases"]
    build_s = result["kernel_build"]["build_s"]
    build = "loaded from the cache" if build_s is None else f"built in {build_s:.1f} s"
    md = ["# C++ CPU kernels vs torch paths (same process, alternating, medians)", "",
          f"{result['when']}, {result['machine']}, torch {result['torch']}. Kernels: {build}.", "",
          NOTES, "", *[f"- {n}" for n in result.get("notes", [])], *([""] if result.get("notes") else []),
          f"## Decode attention, one layer call (SmolLM2 shape, {result['attention']['shape']['dtype']})", "",
          "Per call, averaged over the layers cycled; wall = 2 threads, wall clock; cpu = 1 thread, process CPU time.", "",
          "| threads / clock | batch | context | kernel us | KV GB/s | gather + SDPA us | speedup | "
          f"kernel at {result.get('baseline') or '-'} us | new / old |", "|---|---|---|---|---|---|---|---|---|"]
    for a in attn:
        md.append(f"| {a['threads']} / {a['clock']} | {a['batch']} | {a['ctx_lens']} | {a['kernel_us']} | "
                  f"{a.get('kernel_gb_s', '-')} | {a['gather_us']} | {a['speedup']}x | {a.get('baseline_us', '-')} | "
                  f"{str(a['vs_baseline']) + 'x' if 'vs_baseline' in a else '-'} |")
    if steps:
        md += ["", f"## Whole decode step, {result['decode_step']['model']} fp32 (kernels = paged attention + fused layer ops)", "",
               "| threads / clock | batch | context | kernels ms | torch ms | speedup |", "|---|---|---|---|---|---|"]
        for s in steps:
            md.append(f"| {s['threads']} / {s['clock']} | {s['batch']} | {s['ctx']} | {s['kernels_ms']} | "
                      f"{s['torch_ms']} | {s['speedup']}x |")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()

"""Same-process A/B of the packed bf16 kernel (pair panels) against the dense layout, SmolLM2 in bf16.

1. Matmuls: SmolLM2's four layer matmuls (qkv 576->960, o_proj 576->576, gate_up 576->3072,
   down 1536->576) over 30 layers of distinct random weights (so W streams from DRAM, as in a
   step), at several row counts, 2 threads, wall time:
   - packed: `ops.packed_linear` on the pair-panel weight (what Linear runs for bf16 here),
   - gemv: the dense dot-product kernel (what Linear ran for <= 64 rows before),
   - f_linear: `F.linear` on the dense weight (oneDNN's bf16 matmul; Linear's path above 64 rows before).
   Variants alternate (order flipped every repetition); the best of the repetitions is kept
   (a shared machine only ever makes a pass slower).
2. Whole decode steps of SmolLM2 in bf16 (ModelRunner.execute): the layers' packed Linears against
   dense ones (GPUSERV_PACKED_WEIGHTS=0 layout), alternating blocks of steps; medians.

    .venv/bin/python scripts/bench_packed.py --out bench/results/2026-11-29-cpu-packed-gemm
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from gpuservd.bench.floor import ForeignLoad
from gpuservd.bench.output import write_result
from gpuservd.paths import models_root
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import Linear, pack_pairs
from gpuservd.runner.model_runner import ModelRunner

from bench_cpu_kernels import ab_decode_steps, bench_command_line  # scripts/ is on sys.path when run as a script

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
FLOPS_PER_ROW = 2 * LAYERS * sum(o * i for o, i in SHAPES.values())


def matmul_case(rows: int, reps: int) -> dict:
    ops = cpu_kernels.get()
    g = torch.Generator().manual_seed(rows)
    dense = [[(torch.randn(o, i, generator=g) / 8).bfloat16() for o, i in SHAPES.values()] for _ in range(LAYERS)]
    packed = [[pack_pairs(w) for w in layer] for layer in dense]
    xs = [(torch.randn(rows, i, generator=g) / 8).bfloat16() for _, i in SHAPES.values()]
    outs = [o for o, _ in SHAPES.values()]
    variants = {
        "packed": lambda: [ops.packed_linear(x, w, n, None) for layer in packed for x, w, n in zip(xs, layer, outs)],
        "f_linear": lambda: [F.linear(x, w) for layer in dense for x, w in zip(xs, layer)],
    }
    if rows <= 64:
        variants["gemv"] = lambda: [ops.gemv(x, w, None) for layer in dense for x, w in zip(xs, layer)]
    best = {k: float("inf") for k in variants}
    names = list(variants)
    with torch.inference_mode():
        for r in range(reps + 1):
            for k in names if r % 2 else names[::-1]:
                t0 = time.perf_counter()
                variants[k]()
                if r:  # repetition 0 warms up
                    best[k] = min(best[k], time.perf_counter() - t0)
    case = {"rows": rows, "reps": reps}
    for k, t in best.items():
        case[f"{k}_ms"] = round(t * 1e3, 2)
        case[f"{k}_gflops"] = round(FLOPS_PER_ROW * rows / t / 1e9, 1)
    return case


def _swap_linears(weights, table: dict[int, object]):
    for i, lw in enumerate(weights.layers):
        weights.layers[i] = replace(lw, **{f: table[id(getattr(lw, f))] for f in ("qkv", "o_proj", "gate_up", "down")})


def main():
    args = bench_command_line(__doc__, 7, render_md)
    if args is None:
        return
    if not cpu_kernels.get().packed_available():
        raise SystemExit("no AVX512_BF16 here: the packed kernel is not built or not usable")
    torch.set_num_threads(2)
    result = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared",
              "torch": torch.__version__}
    load = ForeignLoad()
    with load:
        result["matmul"] = []
        for rows in ((1, 8, 32, 128) if args.quick else (1, 8, 16, 32, 48, 64, 128, 256, 512)):
            result["matmul"].append(matmul_case(rows, 3 if args.quick else args.reps))
            print(json.dumps(result["matmul"][-1]), flush=True)
        model_dir = models_root() / args.model
        if (model_dir / "config.json").exists():
            runner = ModelRunner(model_dir, "bfloat16", "cpu", 16, 512 << 20, 4 << 30, 0.5, 4096)
            w = runner.model.weights
            new = [getattr(lw, f) for lw in w.layers for f in ("qkv", "o_proj", "gate_up", "down")]
            old = [Linear(lin.dense().contiguous(), lin.bias, use_packed=False) for lin in new]
            to_old = {id(a): b for a, b in zip(new, old)}
            to_new = {id(b): a for a, b in zip(new, old)}
            state = {"mode": "packed"}

            def go(mode):
                if state["mode"] != mode:
                    _swap_linears(w, to_old if mode == "dense" else to_new)
                    state["mode"] = mode

            steps = []
            for batch, ctx in ([(1, 64), (32, 64)] if args.quick else [(1, 64), (8, 128), (32, 64), (32, 128), (64, 128)]):
                times = ab_decode_steps(runner, batch, ctx, 4 if args.quick else 8, 2 if args.quick else 4, 2,
                                        {"packed": lambda: go("packed"), "dense": lambda: go("dense")})
                med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
                steps.append({"batch": batch, "ctx": ctx, "packed_ms": round(med["packed"], 2),
                              "dense_ms": round(med["dense"], 2), "speedup": round(med["dense"] / med["packed"], 2)})
                print(json.dumps(steps[-1]), flush=True)
            result["decode_step"] = {"model": args.model, "dtype": "bfloat16", "cases": steps,
                                     "note": "the LM head stays packed in both modes: it is the tied embedding"}
    result["foreign_cpu_share"] = load.share
    write_result(args.out, result, render_md(result))


def render_md(result: dict) -> str:
    share = result.get("foreign_cpu_share")
    md = ["# Packed bf16 kernel vs the dense layout, SmolLM2 shapes (same process, alternating)", "",
          f"{result['when']}, {result['machine']}, torch {result['torch']}, 2 threads, wall time; other processes "
          f"used {'?' if share is None else f'{100 * share:.0f}%'} of the machine's CPU while it ran.", ""]
    if result.get("decode_step"):
        md += ["## Whole decode step, smollm2 bf16 (medians)", "",
               "| batch | context | packed ms | dense (gemv / F.linear) ms | speedup |", "|---|---|---|---|---|"]
        md += [f"| {s['batch']} | {s['ctx']} | {s['packed_ms']} | {s['dense_ms']} | {s['speedup']}x |"
               for s in result["decode_step"]["cases"]]
        md += ["", f"({result['decode_step']['note']}.)", ""]
    md += ["## 30 layers of matmuls, weights streamed from DRAM (best of the repetitions)", "",
           "| rows | packed ms (GFLOP/s) | dense gemv ms (GFLOP/s) | F.linear ms (GFLOP/s) |", "|---|---|---|---|"]
    for c in result["matmul"]:
        cells = [f"{c[f'{k}_ms']} ({c[f'{k}_gflops']})" if f"{k}_ms" in c else "-" for k in ("packed", "gemv", "f_linear")]
        md.append(f"| {c['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()

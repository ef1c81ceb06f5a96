"""Same-process A/B of the C++ GEMV kernel against oneDNN for SmolLM2's linear layers.

1. Per matmul, SmolLM2's five shapes (qkv 576->960, o_proj 576->576, gate_up
   576->3072, down 1536->576, lm_head 576->49152) at several row counts:
   - gemv: `ops.gemv` on the dense [out, in] weight (what Linear runs for <= GEMV_MAX_ROWS rows),
   - onednn_dense: oneDNN's inner product on the same dense weight (what Linear runs above),
   - onednn_reordered: oneDNN with its weight reordered once at load (Linear before the kernel).
   Each case cycles over copies of the weight (>= 128 MB in all) so W streams from DRAM,
   as in a model step. Variants alternate (order flipped every repetition); medians.
2. Whole decode steps of SmolLM2 (ModelRunner.execute) with the layers' Linear objects
   (gemv + oneDNN on dense weights) against the same layers rebuilt with reordered oneDNN
   weights, alternating blocks of steps; medians. Plus the batch-1 floor
   (weight bytes per step / read bandwidth, as `gpuserv bench` computes it).

Times: 1 thread as process CPU time (hardly moved by other jobs on a shared machine),
2 threads as wall time. Run under `nice -n 19`; writes result.json and result.md to --out.

    .venv/bin/python scripts/bench_gemv.py --out bench/results/2026-11-29-cpu-gemv
    .venv/bin/python scripts/bench_gemv.py --render bench/results/2026-11-29-cpu-gemv
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from gpuservd.bench.output import write_result
from gpuservd.bench.floor import ForeignLoad, measure_read_bandwidth, weight_bytes_per_decode_step
from gpuservd.paths import models_root
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import GEMV_MAX_ROWS, Linear
from gpuservd.runner.model_runner import ModelRunner

from bench_cpu_kernels import ab_decode_steps, bench_command_line  # scripts/ is on sys.path when run as a script

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
STREAM_BYTES = 128 << 20
BLOCK = 16


class ReorderedLinear:
    """Linear as it was before the GEMV kernel: oneDNN with a weight reordered at load, for every row count."""

    def __init__(self, lin: Linear):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(lin.weight, None)
        self.bias = lin.bias

    def __call__(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def _clock(threads: int):
    return time.perf_counter if threads > 1 else time.process_time


def matmul_case(name: str, rows: int, threads: int, reps: int) -> dict:
    ops = cpu_kernels.get()
    torch.set_num_threads(threads)
    clock = _clock(threads)
    out_f, in_f = SHAPES[name]
    g = torch.Generator().manual_seed(rows)
    copies = max(1, STREAM_BYTES // (out_f * in_f * 4))
    dense = [torch.randn(out_f, in_f, generator=g) for _ in range(copies)]
    reordered = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in dense]
    x = torch.randn(rows, in_f, generator=g)
    variants = {
        "gemv": lambda i: ops.gemv(x, dense[i], None),
        "onednn_dense": lambda i: torch.ops.mkldnn._linear_pointwise(x, dense[i], None, "none", [], ""),
        "onednn_reordered": lambda i: torch.ops.mkldnn._linear_pointwise(x, reordered[i], None, "none", [], ""),
    }
    ref = torch.nn.functional.linear(x, dense[0])
    for fn in variants.values():
        torch.testing.assert_close(fn(0), ref, atol=1e-3, rtol=1e-4)
    times = {k: [] for k in variants}
    names = list(variants)
    with torch.inference_mode():
        for r in range(reps + 1):
            for k in names if r % 2 else names[::-1]:
                t0 = clock()
                for i in range(copies):
                    variants[k](i)
                if r:  # repetition 0 warms up
                    times[k].append((clock() - t0) / copies)
    med = {k: statistics.median(v) for k, v in times.items()}
    nbytes = out_f * in_f * 4
    return {"matmul": name, "out": out_f, "in": in_f, "rows": rows, "threads": threads,
            "clock": "wall" if threads > 1 else "process_cpu", "reps": reps,
            **{f"{k}_us": round(v * 1e6, 1) for k, v in med.items()},
            **{f"{k}_gbs": round(nbytes / v / 1e9, 1) for k, v in med.items()}}


def _swap_linears(weights, table: dict[int, object]):
    """Replace every Linear of the model's weights by table[id(linear)] (or back)."""
    for i, lw in enumerate(weights.layers):
        weights.layers[i] = replace(lw, **{f: table[id(getattr(lw, f))] for f in ("qkv", "o_proj", "gate_up", "down")})
    weights.lm_head = table[id(weights.lm_head)]


def step_case(runner: ModelRunner, batch: int, ctx: int, steps: int, rounds: int, threads: int,
              modes: dict) -> dict:
    times = ab_decode_steps(runner, batch, ctx, steps, rounds, threads, modes)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"batch": batch, "ctx": ctx, "threads": threads, "clock": "wall" if threads > 1 else "process_cpu",
            "steps_each": len(times["gemv"]), "gemv_ms": round(med["gemv"], 2),
            "onednn_reordered_ms": round(med["onednn_reordered"], 2),
            "speedup": round(med["onednn_reordered"] / med["gemv"], 2)}


def main():
    args = bench_command_line(__doc__, 15, render_md)
    if args is None:
        return

    result = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                         "shared with other jobs (run under nice -n 19)",
              "torch": torch.__version__, "gemv_max_rows": GEMV_MAX_ROWS}
    load = ForeignLoad()
    with load:
        mm = []
        rows_list = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32)
        for threads in (1, 2):
            for rows in rows_list:
                for name in SHAPES:
                    if name == "lm_head" and rows > 16:
                        continue
                    mm.append(matmul_case(name, rows, threads, 5 if args.quick else args.reps))
                    print(json.dumps(mm[-1]), flush=True)
        result["matmul"] = mm

        model_dir = models_root() / args.model
        if (model_dir / "config.json").exists():
            torch.set_num_threads(2)
            runner = ModelRunner(model_dir, "float32", "cpu", BLOCK, 512 << 20, 4 << 30, 0.5, 4096)
            w = runner.model.weights
            new = [getattr(lw, f) for lw in w.layers for f in ("qkv", "o_proj", "gate_up", "down")] + [w.lm_head]
            old = [ReorderedLinear(lin) for lin in new]
            to_old = {id(a): b for a, b in zip(new, old)}
            to_new = {id(b): a for a, b in zip(new, old)}
            state = {"mode": "gemv"}

            def go(mode):
                if state["mode"] != mode:
                    _swap_linears(w, to_old if mode == "onednn_reordered" else to_new)
                    state["mode"] = mode

            modes = {"gemv": lambda: go("gemv"), "onednn_reordered": lambda: go("onednn_reordered")}
            steps = []
            cases = [(1, 64), (8, 128)] if args.quick else [(1, 64), (1, 512), (4, 128), (8, 128), (16, 128),
                                                             (32, 128)]
            for threads in (2, 1):
                for batch, ctx in cases:
                    steps.append(step_case(runner, batch, ctx, 4 if args.quick else 8, 2 if args.quick else 4,
                                           threads, modes))
                    print(json.dumps(steps[-1]), flush=True)
            config = json.loads((model_dir / "config.json").read_text())
            wbytes = weight_bytes_per_decode_step(config, 4)
            bw = measure_read_bandwidth(2)
            floor_ms = wbytes / bw * 1e3
            b1 = next(s for s in steps if s["batch"] == 1 and s["threads"] == 2)
            result["decode_step"] = {"model": args.model, "dtype": "float32", "cases": steps}
            result["floor"] = {"weight_bytes": wbytes, "read_bandwidth_gbs": round(bw / 1e9, 1),
                               "floor_step_ms": round(floor_ms, 1), "batch1_ctx": b1["ctx"],
                               "gemv_batch1_ms": b1["gemv_ms"], "gemv_ratio": round(b1["gemv_ms"] / floor_ms, 2),
                               "onednn_reordered_batch1_ms": b1["onednn_reordered_ms"],
                               "onednn_reordered_ratio": round(b1["onednn_reordered_ms"] / floor_ms, 2)}
            print(json.dumps(result["floor"]), flush=True)
    result["foreign_cpu_share"] = load.share
    write_result(args.out, result, render_md(result))


def render_md(result: dict) -> str:
    share = result.get("foreign_cpu_share")
    md = ["# GEMV kernel vs oneDNN, SmolLM2 linear layers (same process, alternating, medians)", "",
          f"{result['when']}, {result['machine']}, torch {result['torch']}; other processes used "
          f"{'?' if share is None else f'{100 * share:.0f}%'} of the machine's CPU while it ran. "
          f"Linear sends <= {result['gemv_max_rows']} rows to gemv, more to oneDNN on the same dense weight.", "",
          "1 thread rows are process CPU time (robust to sharing); 2 thread rows are wall time, which a busy "
          "neighbour inflates (a parallel region waits for its descheduled thread).", ""]
    fl = result.get("floor")
    if fl:
        md += ["## Batch-1 floor", "",
               f"Weight bytes per step {fl['weight_bytes'] / 1e6:.0f} MB, read bandwidth {fl['read_bandwidth_gbs']} GB/s "
               f"(2 threads) -> floor {fl['floor_step_ms']} ms. Batch-1 step (ctx {fl['batch1_ctx']}, 2 threads, wall): "
               f"gemv {fl['gemv_batch1_ms']} ms = {fl['gemv_ratio']}x floor; "
               f"oneDNN reordered {fl['onednn_reordered_batch1_ms']} ms = {fl['onednn_reordered_ratio']}x.", ""]
    if result.get("decode_step"):
        md += ["## Whole decode step, smollm2 fp32", "",
               "| threads / clock | batch | context | gemv + oneDNN dense ms | oneDNN reordered ms | speedup |",
               "|---|---|---|---|---|---|"]
        md += [f"| {s['threads']} / {s['clock']} | {s['batch']} | {s['ctx']} | {s['gemv_ms']} | "
               f"{s['onednn_reordered_ms']} | {s['speedup']}x |" for s in result["decode_step"]["cases"]]
        md.append("")
    md += ["## Per matmul (weights streamed from DRAM)", "",
           "| threads / clock | matmul | out x in | rows | gemv us (GB/s) | oneDNN dense us (GB/s) | "
           "oneDNN reordered us (GB/s) |", "|---|---|---|---|---|---|---|"]
    for c in result["matmul"]:
        cells = [f"{c[f'{k}_us']} ({c[f'{k}_gbs']})" for k in ("gemv", "onednn_dense", "onednn_reordered")]
        md.append(f"| {c['threads']} / {c['clock']} | {c['matmul']} | {c['out']}x{c['in']} | {c['rows']} | "
                  + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()

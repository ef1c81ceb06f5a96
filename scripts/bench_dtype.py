"""fp32 vs bf16 on this CPU: SmolLM2's linear layers and whole decode steps, same process.

Is bfloat16 the faster dtype here? The matmul part times, for SmolLM2's five
linear shapes (qkv 576->960, o_proj 576->576, gate_up 576->3072, down
1536->576, lm_head 576->49152) at rows 1, 8, 32, 64, 256, in fp32 and bf16:
  - linear: `F.linear(x, W)` (what transformers runs; `torch.matmul(x, W.t())`
    dispatches to the same oneDNN matmul),
  - onednn_dense: oneDNN's inner product on the dense [out, in] weight (what
    gpuserv's Linear runs above GEMV_MAX_ROWS),
  - onednn_reordered: oneDNN with its weight reordered once,
  - gemv: gpuserv's C++ kernel with fp32 FMAs (`ops.gemv_widen`; bf16 widened
    to fp32), rows <= 32, and in bf16 gemv_bf16_dp: `ops.gemv`'s AVX512_BF16
    dot-product kernel (vdpbf16ps) where the CPU has it, rows <= 64.
Each case cycles over copies of the weight (>= 64 MB in all) so W streams from
DRAM as in a model step; variants alternate, order flipped every repetition;
medians. Also reported: the oneDNN implementation each call dispatched to
(ONEDNN_VERBOSE in a child process), torch's CPU capability flags.

The layer sweep runs 30 layers' worth of distinct SmolLM2 layer weights in
bf16 (streamed from DRAM, as in a step) through F.linear and the kernels at
rows 1-128: where Linear's bf16 threshold comes from.

The step part times ModelRunner decode steps (batch 1, 8, 32, 64 at context 128)
of a float32 and a bfloat16 runner of the same model, alternating blocks.

2 threads, wall time; run with the machine otherwise quiet (the foreign CPU
share is recorded). Writes result.json and result.md to --out.

    .venv/bin/python scripts/bench_dtype.py --out bench/results/2026-11-29-cpu-dtype
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpuservd.bench.output import write_result
from gpuservd.bench.floor import ForeignLoad
from gpuservd.paths import models_root
from gpuservd.runner import cpu_kernels
from gpuservd.runner.batch import SeqChunk
from gpuservd.runner.linear import GEMV_MAX_ROWS, GEMV_MAX_ROWS_BF16_DP

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
ROWS = (1, 8, 32, 64, 256)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STREAM_BYTES = 64 << 20
BLOCK = 16


def cpu_info() -> dict:
    cap = torch._C._cpu._get_cpu_capability() if hasattr(torch._C._cpu, "_get_cpu_capability") else {}
    flags = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_avx512_bf16": cap.get("avx512_bf16"), "torch_amx_bf16": cap.get("amx_bf16"),
            "mkldnn": torch.backends.mkldnn.is_available(),
            "mkldnn_bf16_supported": bool(getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: None)()),
            "cpuinfo_avx512": sorted(f for f in flags if f.startswith("avx512")),
            "kernels": cpu_kernels.status(), "has_bf16_dp": _has_dp()}


def _has_dp() -> bool:
    ops = cpu_kernels.get()
    return bool(ops is not None and hasattr(ops, "bf16_dp_available") and ops.bf16_dp_available())


def onednn_impls() -> dict:
    """Which oneDNN implementation each call dispatches to, per dtype and row count (a child process)."""
    code = (
        "import torch, torch.nn.functional as F\n"
        "torch.set_num_threads(2)\n"
        "for dt in (torch.float32, torch.bfloat16):\n"
        "    w = torch.randn(3072, 576).to(dt)\n"
        "    for rows in (1, 32, 256):\n"
        "        x = torch.randn(rows, 576).to(dt)\n"
        "        print('@@', str(dt)[6:], rows, 'linear', flush=True); F.linear(x, w)\n"
        "        print('@@', str(dt)[6:], rows, 'onednn_dense', flush=True)\n"
        "        torch.ops.mkldnn._linear_pointwise(x, w, None, 'none', [], '')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "ONEDNN_VERBOSE": "1"}, timeout=120).stdout
    impls, key = {}, None
    for line in out.splitlines():
        if line.startswith("@@"):
            key = " ".join(line.split()[1:])
        elif key and ",primitive,exec," in line:
            parts = line.split(",")
            impls[key] = f"{parts[5]} {parts[6]}"  # primitive kind, implementation
    return impls


def alternating_medians(names: list[str], one_pass, reps: int) -> dict[str, float]:
    """Median seconds of one_pass(name) per name over `reps` rounds after a warm-up round, the order
    alternating every round so neither variant always runs on a warmer cache."""
    times = {k: [] for k in names}
    with torch.inference_mode():
        for r in range(reps + 1):
            for k in names if r % 2 else names[::-1]:
                t0 = time.perf_counter()
                one_pass(k)
                if r:  # round 0 warms up
                    times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def matmul_case(name: str, rows: int, dtype: torch.dtype, reps: int) -> dict:
    ops = cpu_kernels.get()
    out_f, in_f = SHAPES[name]
    g = torch.Generator().manual_seed(rows)
    esize = torch.tensor([], dtype=dtype).element_size()
    copies = max(1, STREAM_BYTES // (out_f * in_f * esize))
    # Large row counts are compute-bound: fewer copies keep the run short without changing the rate.
    copies = max(1, min(copies, int(4e9 // (2 * rows * out_f * in_f))))
    dense = [torch.randn(out_f, in_f, generator=g).to(dtype) for _ in range(copies)]
    reordered = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in dense]
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    variants = {
        "linear": lambda i: F.linear(x, dense[i]),
        "onednn_dense": lambda i: torch.ops.mkldnn._linear_pointwise(x, dense[i], None, "none", [], ""),
        "onednn_reordered": lambda i: torch.ops.mkldnn._linear_pointwise(x, reordered[i], None, "none", [], ""),
    }
    if ops is not None and rows <= GEMV_MAX_ROWS:
        variants["gemv"] = lambda i: ops.gemv_widen(x, dense[i], None)  # fp32 FMAs (bf16 widened)
    if ops is not None and rows <= GEMV_MAX_ROWS_BF16_DP and dtype == torch.bfloat16 and _has_dp():
        variants["gemv_bf16_dp"] = lambda i: ops.gemv(x, dense[i], None)
    ref = F.linear(x.float(), dense[0].float())
    tol = dict(atol=1e-3, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    for fn in variants.values():
        torch.testing.assert_close(fn(0).float(), ref, **tol)
    def one_pass(k):
        for i in range(copies):
            variants[k](i)

    med = {k: v / copies for k, v in alternating_medians(list(variants), one_pass, reps).items()}
    flop = 2 * rows * out_f * in_f
    return {"matmul": name, "dtype": str(dtype)[6:], "rows": rows, "copies": copies, "reps": reps,
            **{f"{k}_us": round(v * 1e6, 1) for k, v in med.items()},
            **{f"{k}_gflops": round(flop / v / 1e9, 1) for k, v in med.items()}}


LAYER_SHAPES = [SHAPES[k] for k in ("qkv", "o_proj", "gate_up", "down")]
LAYER_ROWS = (1, 8, 32, 48, 64, 96, 128)


def layer_sweep(rows: int, reps: int) -> dict:
    """One pass over 30 layers' worth of distinct SmolLM2 layer weights (streamed from DRAM, as in a
    step) per way of running a bf16 linear: ms per pass, medians, variants alternating."""
    ops = cpu_kernels.get()
    g = torch.Generator().manual_seed(rows)
    ws = [[torch.randn(n, k, generator=g).bfloat16() for n, k in LAYER_SHAPES] for _ in range(30)]
    xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in (576, 1536)}
    variants = {"linear": lambda x, w: F.linear(x, w)}
    if _has_dp():
        variants["gemv_bf16_dp"] = lambda x, w: ops.gemv(x, w, None)
    if rows <= GEMV_MAX_ROWS and ops is not None:
        variants["gemv_widen"] = lambda x, w: ops.gemv_widen(x, w, None)

    def one_pass(k):
        for layer in ws:
            for w in layer:
                variants[k](xs[w.shape[1]], w)

    med = alternating_medians(list(variants), one_pass, reps)
    flop = 2 * rows * 30 * sum(n * k for n, k in LAYER_SHAPES)
    return {"rows": rows, "dtype": "bfloat16", **{f"{k}_ms": round(v * 1e3, 2) for k, v in med.items()},
            **{f"{k}_gflops": round(flop / v / 1e9, 1) for k, v in med.items()}}


def decode_steps(runners: dict, batch: int, ctx: int, steps: int, rounds: int) -> dict[str, float]:
    """Median step ms per runner: `steps` decode steps of `batch` sequences at context ~ctx, blocks alternating."""
    state = {}
    for name, runner in runners.items():
        tables = [runner.cache.pool.allocate(-(-(ctx + steps * (rounds + 1) * 2 + 8) // BLOCK)) for _ in range(batch)]
        prompt = [(11 + 7 * i) % 4000 + 3 for i in range(ctx)]
        for t in tables:
            runner.execute([SeqChunk(prompt, 0, t, True)])
        state[name] = {"tables": tables, "pos": [ctx] * batch, "times": []}
    names = list(runners)
    try:
        for r in range(rounds + 1):
            for name in names if r % 2 else names[::-1]:
                st, runner = state[name], runners[name]
                for _ in range(steps):
                    chunks = [SeqChunk([5], st["pos"][i], st["tables"][i], True) for i in range(batch)]
                    t0 = time.perf_counter()
                    runner.execute(chunks)
                    if r:
                        st["times"].append(time.perf_counter() - t0)
                    st["pos"] = [p + 1 for p in st["pos"]]
    finally:
        for name, runner in runners.items():
            for t in state[name]["tables"]:
                runner.cache.pool.free(t)
    return {name: round(statistics.median(state[name]["times"]) * 1e3, 2) for name in names}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--render", type=Path, help="only rewrite DIR/result.md from DIR/result.json")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--skip-matmul", action="store_true")
    ap.add_argument("--skip-steps", action="store_true")
    args = ap.parse_args()
    if args.render:
        (args.render / "result.md").write_text(render_md(json.loads((args.render / "result.json").read_text())))
        return
    if not args.out:
        ap.error("--out or --render is required")
    torch.set_num_threads(2)
    from gpuservd.runner.model_runner import ModelRunner

    result = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
              "torch": torch.__version__, "threads": 2, "gemv_max_rows": GEMV_MAX_ROWS,
              "gemv_max_rows_bf16_dp": GEMV_MAX_ROWS_BF16_DP, "cpu": cpu_info(),
              "onednn_impls": onednn_impls()}
    print(json.dumps(result), flush=True)
    load = ForeignLoad()
    with load:
        if not args.skip_matmul:
            mm = []
            for rows in ROWS:
                for name in SHAPES:
                    if name == "lm_head" and rows > 64:
                        continue  # only sampled rows reach the LM head (<= max_num_seqs)
                    for dtype in DTYPES.values():
                        m_load = ForeignLoad()
                        with m_load:
                            mm.append(matmul_case(name, rows, dtype, args.reps))
                        mm[-1]["foreign_cpu_share"] = None if m_load.share is None else round(m_load.share, 3)
                        print(json.dumps(mm[-1]), flush=True)
            result["matmul"] = mm
            sweep = []
            for rows in LAYER_ROWS:
                l_load = ForeignLoad()
                with l_load:
                    sweep.append(layer_sweep(rows, 5))
                sweep[-1]["foreign_cpu_share"] = None if l_load.share is None else round(l_load.share, 3)
                print(json.dumps(sweep[-1]), flush=True)
            result["layer_sweep"] = sweep
        model_dir = models_root() / args.model
        if not args.skip_steps and (model_dir / "config.json").exists():
            runners = {d: ModelRunner(model_dir, d, "cpu", BLOCK, 512 << 20, 4 << 30, 0.5, 4096) for d in DTYPES}
            steps = []
            for batch in (1, 8, 32, 64):
                s_load = ForeignLoad()
                with s_load:
                    ms = decode_steps(runners, batch, 128, 6 if batch < 32 else 4, 4)
                steps.append({"batch": batch, "ctx": 128, **{f"{k}_ms": v for k, v in ms.items()},
                              "bf16_speedup": round(ms["float32"] / ms["bfloat16"], 2),
                              "foreign_cpu_share": None if s_load.share is None else round(s_load.share, 3)})
                print(json.dumps(steps[-1]), flush=True)
            result["decode_step"] = {"model": args.model, "cases": steps}
    result["foreign_cpu_share"] = load.share
    write_result(args.out, result, render_md(result))


def render_md(result: dict) -> str:
    share = result.get("foreign_cpu_share")
    cpu = result["cpu"]
    md = ["# fp32 vs bf16 on this CPU (same process, alternating, medians, 2 threads, wall time)", "",
          f"{result['when']}, {result['machine']}, torch {result['torch']}; other processes used "
          f"{'?' if share is None else f'{100 * share:.1f}%'} of the machine's CPU while it ran.", "",
          f"torch CPU capability {cpu['torch_cpu_capability']}, avx512_bf16 {cpu['torch_avx512_bf16']}, "
          f"amx_bf16 {cpu['torch_amx_bf16']}; /proc/cpuinfo: {' '.join(cpu['cpuinfo_avx512'])}. "
          f"gpuserv bf16 dot-product GEMV: {cpu['has_bf16_dp']}.", "",
          "oneDNN implementation per call (3072x576 weight): "
          + "; ".join(f"{k}: {v}" for k, v in result["onednn_impls"].items()), ""]
    if result.get("decode_step"):
        md += [f"## Whole decode step, {result['decode_step']['model']} (ModelRunner, context 128)", "",
               "| batch | fp32 ms | bf16 ms | fp32 / bf16 | foreign CPU |", "|---|---|---|---|---|"]
        md += [f"| {s['batch']} | {s['float32_ms']} | {s['bfloat16_ms']} | {s['bf16_speedup']}x | "
               f"{100 * (s['foreign_cpu_share'] or 0):.1f}% |" for s in result["decode_step"]["cases"]]
        md.append("")
    if result.get("layer_sweep"):
        md += ["## bf16, 30 layers of SmolLM2 linears streamed from DRAM: ms per pass (GFLOP/s)", "",
               "Which bf16 row counts Linear sends to the dot-product gemv (up to "
               f"{result.get('gemv_max_rows_bf16_dp', 64)}) rather than F.linear's oneDNN matmul.", "",
               "| rows | F.linear | gemv_bf16_dp | gemv_widen | foreign CPU |", "|---|---|---|---|---|"]
        for m in result["layer_sweep"]:
            cells = [f"{m[v + '_ms']} ({m[v + '_gflops']})" if v + "_ms" in m else "-"
                     for v in ("linear", "gemv_bf16_dp", "gemv_widen")]
            md.append(f"| {m['rows']} | " + " | ".join(cells) + f" | {100 * (m.get('foreign_cpu_share') or 0):.1f}% |")
        md.append("")
    if result.get("matmul"):
        variants = ["linear", "onednn_dense", "onednn_reordered", "gemv", "gemv_bf16_dp"]
        md += ["## Linear layers: GFLOP/s (us per call)", "",
               "| matmul | rows | dtype | " + " | ".join(variants) + " | foreign CPU |",
               "|---|---|---|" + "---|" * (len(variants) + 1)]
        for m in result["matmul"]:
            cells = [f"{m[v + '_gflops']} ({m[v + '_us']})" if v + "_us" in m else "-" for v in variants]
            md.append(f"| {m['matmul']} | {m['rows']} | {m['dtype']} | " + " | ".join(cells)
                      + f" | {100 * (m.get('foreign_cpu_share') or 0):.1f}% |")
        md.append("")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()

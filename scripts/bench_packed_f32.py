"""Same-process A/B of the packed fp32 kernel (column panels) against the dense layout, SmolLM2 in fp32.

1. Matmuls, per shape: SmolLM2's four layer matmuls (qkv 576->960, o_proj 576->576, gate_up
   576->3072, down 1536->576) and its tied LM head (576->49152), each cycled over >= 256 MB of
   distinct random copies (so W streams from DRAM, as in a decode step), at several row counts:
   - packed: `ops.packed_linear_f32` on the panel weight (what Linear runs for fp32 now),
   - packed_bf16: the same kernel on bf16 panels of the same (bf16-exact) values, which Linear
     takes for a weight whose values are all bf16 (SmolLM2's LM head): identical outputs, half the bytes,
   - gemv: the dense dot-product kernel (what Linear ran for <= 32 rows before),
   - onednn: oneDNN's inner product on the dense weight (Linear's path above 32 rows before),
   - f_linear: `F.linear` (MKL).
   Variants alternate (order flipped every repetition); the best repetition is kept. Each case also
   says ms per matmul and how close it comes to the read floor: the same bytes read by a plain
   streaming sum (`floor_ms`, measured here per shape), as `packed_of_floor` = floor / packed time.
   --rows 1,4,8,16 --variants packed,packed_bf16 picks the small-batch cases alone.
2. Whole decode steps of SmolLM2 in fp32 (ModelRunner.execute) at 1/8/24/48 sequences: the packed
   Linears (layers and the tied LM head) against the dense ones the engine ran before
   (GPUSERV_PACKED_WEIGHTS=0: gemv up to 32 rows, oneDNN above), alternating blocks of steps; medians.

0. The ceilings first (scripts/cpu_ceilings.py): this CPU's fp32 FMA peak (independent-chain FMA loop,
   1 and --threads threads) and its read bandwidth (the decode-floor probe). Every matmul case then says
   its roofline time, max(weight bytes / read bandwidth, 2 rows N K / FMA peak), which ceiling sets it
   (`bound`: read at few rows, fma at many) and `packed_of_roofline` = roofline / packed time.
   --no-ceilings skips them (the fractions are then left out).

--baseline REV adds the variant `packed_base`: packed_linear_f32 as of git revision REV (its
packed_gemm_f32.cpp built beside the current one under another op namespace), alternated with the
current kernel in the same process, for a before/after of a kernel change.

--threads 1 times with process CPU time (fair on a loaded machine), 2+ with wall time. Each case keeps the
best repetition (`*_ms`) and the median one (`*_med_ms`).

--busy N runs N busy-looping processes at the bench's own priority beside the matmul cases: the competing
load a 2-thread call meets in the daemon (the event loop's thread and the engine's Python while the pool
works), where a call's time is set by its threads' split of the work more than by the best repetition.

    .venv/bin/python scripts/bench_packed_f32.py --out bench/results/DATE-cpu-packed-f32 --threads 2
    .venv/bin/python scripts/bench_packed_f32.py --out DIR --no-steps --variants packed --baseline HEAD~3
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from gpuservd.bench.floor import ForeignLoad
from gpuservd.bench.output import write_result
from gpuservd.paths import models_root
from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import Linear, onednn_available, pack_panels
from gpuservd.runner.model_runner import ModelRunner

import cpu_ceilings  # scripts/ is on sys.path when run as a script
from bench_cpu_kernels import ab_decode_steps, bench_command_line, kernel_at_revision
from bench_packed import _swap_linears

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
STREAM_BYTES = 256 << 20  # distinct copies per shape: more than the caches hold
ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 256)
VARIANTS = ("packed", "packed_bf16", "gemv", "onednn", "f_linear")
BASE_NS = "gpuserv_f32base"  # the op namespace of --baseline's kernel


def baseline_ops(rev: str):
    """packed_linear_f32 as of git revision `rev`, built under the op namespace BASE_NS."""
    return kernel_at_revision(rev, "packed_gemm_f32.cpp", BASE_NS)


def read_floor(tensors, reps: int, clock) -> float:
    """Seconds to stream the tensors once (a sum of each: the bytes at the machine's read bandwidth)."""
    best = float("inf")
    for r in range(reps + 1):
        t0 = clock()
        for t in tensors:
            t.sum()
        if r:
            best = min(best, clock() - t0)
    return best


def shape_cases(name: str, rows_list, reps: int, clock, wanted, base=None, ceilings=None, threads=2) -> list[dict]:
    ops = cpu_kernels.get()
    n, k = SHAPES[name]
    g = torch.Generator().manual_seed(n + k)
    copies = max(2, -(-STREAM_BYTES // (n * k * 4)))
    dense = [(torch.randn(n, k, generator=g) / 8).bfloat16().float() for _ in range(copies)]  # bf16-exact values
    packed = [pack_panels(w) for w in dense]
    halves = [ops.pack_panels_bf16(w) for w in dense] if "packed_bf16" in wanted else []
    floor = read_floor(packed, reps, clock) / copies
    out = []
    for rows in rows_list:
        x = torch.randn(rows, k, generator=g) / 8
        variants = {
            "packed": lambda: [ops.packed_linear_f32(x, w, n, None) for w in packed],
            "packed_bf16": lambda: [ops.packed_linear_f32(x, w, n, None) for w in halves],
            "packed_base": lambda: [base.packed_linear_f32(x, w, n, None) for w in packed],
            "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in dense],
            "f_linear": lambda: [F.linear(x, w) for w in dense],
        }
        if rows <= 64:
            variants["gemv"] = lambda: [ops.gemv(x, w, None) for w in dense]
        variants = {v: f for v, f in variants.items() if v in wanted or (v == "packed_base" and base is not None)}
        times = {v: [] for v in variants}
        names = list(variants)
        with torch.inference_mode():
            for r in range(reps + 1):
                for v in names if r % 2 else names[::-1]:
                    t0 = clock()
                    variants[v]()
                    if r:  # repetition 0 warms up
                        times[v].append(clock() - t0)
        best = {v: min(t) for v, t in times.items()}
        case = {"shape": name, "rows": rows, "copies": copies, "weight_mb": round(n * k * 4 / 1e6, 1),
                "floor_ms": round(floor * 1e3, 3)}
        for v, t in best.items():
            case[f"{v}_gflops"] = round(2 * rows * n * k * copies / t / 1e9, 1)
            case[f"{v}_ms"] = round(t / copies * 1e3, 3)
            case[f"{v}_med_ms"] = round(statistics.median(times[v]) / copies * 1e3, 3)
            case[f"{v}_of_floor"] = round(floor * copies / t, 2)
        if ceilings is not None:
            roof, bound = cpu_ceilings.roofline_s(rows, n, k, n * k * 4, ceilings, threads)
            case.update(roofline_ms=round(roof * 1e3, 3), bound=bound)
            for v, t in best.items():
                case[f"{v}_of_roofline"] = round(roof * copies / t, 2)
                case[f"{v}_of_peak"] = round(2 * rows * n * k * copies / t / 1e9
                                             / cpu_ceilings.peak_gflops(ceilings, threads), 2)
        out.append(case)
        print(json.dumps(case), flush=True)
    return out


@contextmanager
def busy(n: int):
    """n processes spinning in a loop (none for n = 0) while the block runs; each also stops when the bench
    dies without reaching `finally` (SIGTERM, SIGKILL): its parent changes then."""
    spin = f"import os\nwhile os.getppid() == {os.getpid()}: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def decode_steps(args, threads: int) -> dict:
    runner = ModelRunner(models_root() / args.model, "float32", "cpu", 16, 512 << 20, 4 << 30, 0.5, 4096)
    w = runner.model.weights
    if not w.lm_head.panels:
        raise SystemExit("the model did not load into fp32 panels (GPUSERV_PACKED_WEIGHTS=0?)")
    onednn = onednn_available(torch.device("cpu"), torch.float32)
    new = [getattr(lw, f) for lw in w.layers for f in ("qkv", "o_proj", "gate_up", "down")]
    old = [Linear(lin.dense().contiguous(), lin.bias, onednn, use_packed=False) for lin in new]
    heads = {"packed": w.lm_head, "dense": Linear(w.lm_head.dense().contiguous(), None, onednn, use_packed=False)}
    to_old = {id(a): b for a, b in zip(new, old)}
    to_new = {id(b): a for a, b in zip(new, old)}
    state = {"mode": "packed"}

    def go(mode):
        if state["mode"] != mode:
            _swap_linears(w, to_old if mode == "dense" else to_new)
            w.lm_head = heads[mode]  # embedding rows follow: embed is None, rows() reads either layout
            state["mode"] = mode

    steps = []
    for batch in ((1, 48) if args.quick else (1, 8, 24, 48)):
        times = ab_decode_steps(runner, batch, 50, 4 if args.quick else 8, 2 if args.quick else 4, threads,
                                {"packed": lambda: go("packed"), "dense": lambda: go("dense")})
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        steps.append({"batch": batch, "ctx": 50, "packed_ms": round(med["packed"], 2),
                      "dense_ms": round(med["dense"], 2), "speedup": round(med["dense"] / med["packed"], 2)})
        print(json.dumps(steps[-1]), flush=True)
    return {"model": args.model, "dtype": "float32", "cases": steps}


def main():
    def extra(ap):
        ap.add_argument("--threads", type=int, default=2)
        ap.add_argument("--rows", help="comma-separated row counts (default: %s)" % ",".join(map(str, ROWS)))
        ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ",".join(SHAPES))
        ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ",".join(VARIANTS))
        ap.add_argument("--no-steps", action="store_true", help="skip the whole decode steps")
        ap.add_argument("--no-ceilings", action="store_true", help="skip the FMA-peak and read-bandwidth probes")
        ap.add_argument("--busy", type=int, default=0, help="busy-looping processes beside the matmul cases")

    args = bench_command_line(__doc__, 5, render_md, extra)
    if args is None:
        return
    if not hasattr(cpu_kernels.get(), "packed_linear_f32"):
        raise SystemExit("the kernels lack packed_linear_f32")
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.threads > 1 else time.process_time
    result = {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared",
              "torch": torch.__version__, "threads": args.threads,
              "clock": "wall" if args.threads > 1 else "process_cpu"}
    base = baseline_ops(args.baseline) if args.baseline else None
    result["baseline"] = args.baseline
    load = ForeignLoad()
    with load:
        ceilings = None if args.no_ceilings else cpu_ceilings.measure(args.threads)
        result["ceilings"] = ceilings
        print(json.dumps({"ceilings": ceilings}), flush=True)
        rows = [int(r) for r in args.rows.split(",")] if args.rows else (1, 8, 32, 256) if args.quick else ROWS
        wanted = set(args.variants.split(","))
        result["busy"] = args.busy
        with busy(args.busy):
            result["matmul"] = [c for name in args.shapes.split(",")
                                for c in shape_cases(name, rows, 2 if args.quick else args.reps, clock, wanted,
                                                     base, ceilings, args.threads)]
        if not args.no_steps and (models_root() / args.model / "config.json").exists():
            result["decode_step"] = decode_steps(args, args.threads)
    result["foreign_cpu_share"] = load.share
    write_result(args.out, result, render_md(result))


def render_md(result: dict) -> str:
    share = result.get("foreign_cpu_share")
    md = ["# Packed fp32 kernel (column panels) vs the dense layout, SmolLM2 shapes (same process, alternating)", "",
          f"{result['when']}, {result['machine']}, torch {result['torch']}, {result['threads']} thread(s), "
          f"{result['clock']} time; other processes used {'?' if share is None else f'{100 * share:.0f}%'} of the "
          "machine's CPU while it ran.", ""]
    ceil = result.get("ceilings")
    if ceil:
        fma = ", ".join(f"{f['threads']} thread(s) x {f['acc']} chains {f['gflops_cpu']} (wall {f['gflops_wall']})"
                        for f in ceil["fma"])
        reads = ", ".join(f"{t} thread(s) {v} GB/s" for t, v in ceil["read_gb_s"].items())
        md += ["## Ceilings (scripts/cpu_ceilings.py)", "",
               f"fp32 FMA GFLOP/s per CPU-second: {fma}. Read bandwidth: {reads}.", "",
               "| shape | rows | bound | roofline ms | packed ms | packed of roofline | packed of FMA peak |"
               + (" base ms | base of roofline |" if result.get("baseline") else ""),
               "|---|---|---|---|---|---|---|" + ("---|---|" if result.get("baseline") else "")]
        for c in result["matmul"]:
            if "roofline_ms" not in c or "packed_ms" not in c:
                continue
            row = (f"| {c['shape']} | {c['rows']} | {c['bound']} | {c['roofline_ms']} | {c['packed_ms']} | "
                   f"{c['packed_of_roofline']} | {c['packed_of_peak']} |")
            if result.get("baseline"):
                row += f" {c.get('packed_base_ms', '-')} | {c.get('packed_base_of_roofline', '-')} |"
            md.append(row)
        md.append("")
    if result.get("baseline"):
        md += [f"## Before/after: packed_linear_f32 now against {result['baseline']} (same process, alternating"
               f"{', %d busy processes beside' % result['busy'] if result.get('busy') else ''})", "",
               "| shape | rows | now ms best / median | base ms best / median | base/now best | base/now median |",
               "|---|---|---|---|---|---|"]
        for c in result["matmul"]:
            if "packed_ms" in c and "packed_base_ms" in c:
                md.append(f"| {c['shape']} | {c['rows']} | {c['packed_ms']} / {c['packed_med_ms']} | "
                          f"{c['packed_base_ms']} / {c['packed_base_med_ms']} | "
                          f"{c['packed_base_ms'] / c['packed_ms']:.2f} | "
                          f"{c['packed_base_med_ms'] / c['packed_med_ms']:.2f} |")
        md.append("")
    if result.get("decode_step"):
        md += ["## Whole decode step, fp32, context 50 (medians)", "",
               "| batch | packed ms | dense (gemv <= 32 rows / oneDNN) ms | speedup |", "|---|---|---|---|"]
        md += [f"| {s['batch']} | {s['packed_ms']} | {s['dense_ms']} | {s['speedup']}x |"
               for s in result["decode_step"]["cases"]]
        md.append("")
    md += ["## GFLOP/s per matmul shape, W cycled over >= 256 MB of copies (best of the repetitions)", "",
           "| shape | rows | packed | packed bf16 | gemv | oneDNN | F.linear |", "|---|---|---|---|---|---|---|"]
    for c in result["matmul"]:
        cells = [str(c.get(f"{k}_gflops", "-")) for k in ("packed", "packed_bf16", "gemv", "onednn", "f_linear")]
        md.append(f"| {c['shape']} | {c['rows']} | " + " | ".join(cells) + " |")
    md += ["", "## ms per matmul against the read floor (the fp32 weight's bytes streamed by a sum)", "",
           "| shape | rows | fp32 MB | floor ms | packed ms (of floor) | packed bf16 ms (of floor) |",
           "|---|---|---|---|---|---|"]
    for c in result["matmul"]:
        cells = [f"{c[f'{k}_ms']} ({c[f'{k}_of_floor']})" if f"{k}_ms" in c else "-" for k in ("packed", "packed_bf16")]
        md.append(f"| {c['shape']} | {c['rows']} | {c.get('weight_mb', '-')} | {c.get('floor_ms', '-')} | "
                  + " | ".join(cells) + " |")
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()

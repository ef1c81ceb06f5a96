"""Where a burst's requests spend their latency: waiting for a slot, prefill steps, decode steps.

Replays a `gpuserv bench` workload on an in-process engine (as engine_run.run_gpuserv does) and records
which requests each step scheduled, then splits every request's latency into
- wait:    arrival -> the end of the step before its first chunk (no slot, or no prefill budget),
- prefill: its first chunk's step -> its first token (the steps that carried its prompt),
- decode:  first token -> last token,
with the number of steps and the mean step time of each part, per class.

    PYTHONPATH=$PWD .venv/bin/python scripts/burst_breakdown.py -w profiles/workloads/mixed-short-long.yaml \
        -c profiles/engine/peers-48.yaml [--set scheduler.order=fcfs ...] [--json OUT.json]

On a shared machine, `--threads 1 --clock cpu` times the run in the process's CPU seconds (one thread:
the engine's own work, which other jobs do not stretch) and `--until short` stops once that class is done
(the short phase of a burst, whose slowest request sets the short class's P99), so A/B runs take seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from gpuservd.bench.engine_run import _params, commit_kv_pool, warm_up
from gpuservd.bench.random_model import LlamaShape, ensure_random_llama
from gpuservd.bench.workload import load_workload
from gpuservd.config import load_config
from gpuservd.engine.engine import LLMEngine
from gpuservd.runner import cpu_isa
from gpuservd.store.store import ModelStore

# The simulation's model: only the scheduler's decisions matter, and they depend on token counts alone.
SIM_SHAPE = LlamaShape(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=49152)


def apply_sets(cfg, sets: list[str]) -> None:
    """`section.field=value` overrides (value parsed as JSON when it parses, else a string)."""
    for item in sets:
        key, _, raw = item.partition("=")
        obj = cfg
        *path, last = key.split(".")
        for p in path:
            obj = getattr(obj, p)
        if not hasattr(obj, last):
            raise SystemExit(f"--set {item}: no field {key}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        setattr(obj, last, value)


class StepCost:
    """A modeled step time (seconds) for SmolLM2 fp32 on the 2-core Zen 3 VM: a fixed part, a part per row
    (a decode token or a prefill token: the linear layers and the LM head are compute-bound at these row
    counts) and a part per token of context a decode row reads (paged attention). Fitted to session 11's
    decode steps (1 / 8 / 24 / 48 rows: 25-30 / 32-47 / 63-101 / 115-168 ms; 8 rows at ~480 tokens of
    context ~60 ms) so that policies can be compared in a run that takes seconds and no quiet machine."""

    def __init__(self, base_ms=22.0, row_ms=2.2, ctx_us=4.2):
        self.base, self.row, self.ctx = base_ms / 1e3, row_ms / 1e3, ctx_us / 1e6

    def __call__(self, chunks) -> float:
        rows = sum(n for _, n, _ in chunks)
        context = sum(start + 1 for _, n, start in chunks if n == 1)
        return self.base + self.row * rows + self.ctx * context


def replay(engine, requests, cost: StepCost | None = None, cpu_clock: bool = False,
           until: str | None = None) -> tuple[list[dict], dict[str, dict]]:
    """Run the requests; returns per-step records and per-request times (seconds from the start). With
    `cost`, time is the modeled step times' sum (the engine's own speed does not count); with cpu_clock,
    the process's CPU seconds. until: stop (aborting the rest) once every request of this class is done."""
    steps: list[dict] = []
    sched = engine.scheduler
    inner = sched.schedule

    def schedule():
        out = inner()
        steps.append({"chunks": [(c.request.request_id, c.num_tokens, c.start_pos) for c in out.chunks]})
        return out

    sched.schedule = schedule
    pending = sorted(requests, key=lambda r: r.arrival_s)
    reqs = {r.request_id: {"cls": r.cls, "arrival": r.arrival_s, "prompt": len(r.prompt_token_ids),
                           "output": r.output_tokens} for r in pending}
    timer = time.process_time if cpu_clock else time.perf_counter
    t0 = timer()
    model_clock = [0.0]

    def clock() -> float:
        return model_clock[0] if cost is not None else timer() - t0

    left = sum(1 for q in reqs.values() if q["cls"] == until)

    i = 0
    while i < len(pending) or engine.has_unfinished():
        now = clock()
        while i < len(pending) and pending[i].arrival_s <= now:
            r = pending[i]
            engine.add_request(r.request_id, r.prompt_token_ids, _params(r.output_tokens))
            i += 1
        if not engine.has_unfinished():
            if cost is not None:
                model_clock[0] = pending[i].arrival_s
            else:
                time.sleep(max(0.0, pending[i].arrival_s - clock()))
            continue
        begin = clock()
        outs = engine.step()
        rec = steps[-1]
        if cost is not None:
            model_clock[0] += cost(rec["chunks"])
        end = clock()
        rec.update(begin=begin, end=end)
        for rid, *_ in rec["chunks"]:
            reqs[rid].setdefault("first_step", len(steps) - 1)
        for o in outs:
            q = reqs[o.request_id]
            if "first_token" not in q:
                q["first_token"], q["first_token_step"] = end, len(steps) - 1
            if o.finished:
                q["done"], q["done_step"] = end, len(steps) - 1
                left -= q["cls"] == until
        if until is not None and left == 0:
            for rid in list(engine.requests):
                engine.abort(rid)
            break
    sched.schedule = inner
    return steps, reqs


def breakdown(steps: list[dict], reqs: dict[str, dict]) -> dict:
    """Per class: medians and maxima of each part, and the request that finished last."""
    out = {}
    for cls in sorted({q["cls"] for q in reqs.values()}):
        rows = []
        for rid, q in reqs.items():
            if q["cls"] != cls or "done" not in q:  # not done: stopped by --until
                continue
            f, ft, d = q["first_step"], q["first_token_step"], q["done_step"]
            admitted = steps[f]["begin"]
            rows.append({"id": rid, "prompt": q["prompt"], "output": q["output"],
                         "wait_s": admitted - q["arrival"], "prefill_s": q["first_token"] - admitted,
                         "prefill_steps": ft - f + 1, "decode_s": q["done"] - q["first_token"],
                         "decode_steps": d - ft, "latency_s": q["done"] - q["arrival"],
                         "ttft_s": q["first_token"] - q["arrival"]})
        if not rows:
            continue
        lat = sorted(r["latency_s"] for r in rows)
        last = max(rows, key=lambda r: r["latency_s"])
        out[cls] = {"n": len(rows), "last": last, "latency_s_p99": percentile(lat, 99),
                    **{f"{k}_p50": statistics.median(r[k] for r in rows) for k in
                       ("wait_s", "prefill_s", "decode_s", "latency_s", "ttft_s")},
                    **{f"{k}_max": max(r[k] for r in rows) for k in ("wait_s", "latency_s")}}
    return out


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of sorted values, interpolated between the nearest ranks (numpy's default)."""
    k = (len(values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def phase_steps(steps: list[dict], end: float) -> dict:
    """The steps that began before `end` (a phase), by kind: count, seconds, prefill tokens, decode rows."""
    out: dict[str, dict] = {}
    for s in steps:
        if s["begin"] >= end:
            break
        pf = sum(n for _, n, _ in s["chunks"] if n > 1)
        rows = sum(1 for _, n, _ in s["chunks"] if n == 1)
        k = out.setdefault("prefill" if pf else "decode", {"steps": 0, "s": 0.0, "prefill_tokens": 0, "rows": 0})
        k["steps"] += 1
        k["s"] += s["end"] - s["begin"]
        k["prefill_tokens"] += pf
        k["rows"] += rows
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-w", "--workload", type=Path, required=True)
    ap.add_argument("-c", "--config", type=Path)
    ap.add_argument("--set", action="append", default=[], help="section.field=value (repeatable)")
    ap.add_argument("--json", type=Path, help="write steps, requests and the breakdown here")
    ap.add_argument("--simulate", action="store_true",
                    help="a tiny random model in a private store and modeled step times (StepCost)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time in the process's CPU seconds (use with --threads 1 on a shared machine)")
    ap.add_argument("--threads", type=int, help="engine.num_threads")
    ap.add_argument("--isa", choices=cpu_isa.CHOICES, help="GPUSERV_CPU_ISA for this run (avx2: the AVX2 kernels)")
    ap.add_argument("--until", metavar="CLASS", help="stop once every request of this class is done")
    ap.add_argument("--repeats", type=int, default=1, help="replay the workload this many times on one engine")
    args = ap.parse_args()
    if args.isa:
        os.environ[cpu_isa.ENV] = args.isa
    cpu_isa.apply()
    workload = load_workload(args.workload)
    cfg = load_config(args.config)
    apply_sets(cfg, args.set)
    cfg.model = workload.model
    if args.threads:
        cfg.num_threads = args.threads
    if args.repeats > 1:  # a replay's prompts would hit the cache the next time (the bench's run hits none)
        cfg.prefix_caching = False
    store = ModelStore()
    if args.simulate:
        store = ModelStore(Path(tempfile.mkdtemp(prefix="burst-sim-")))
        cfg.model = ensure_random_llama(store, "sim-tiny", SIM_SHAPE)
        cfg.dtype = "float32"
    engine = LLMEngine(cfg.model, store.path(cfg.model), cfg)
    commit_kv_pool(engine)  # as the daemon's idle loop does before a burst arrives
    tok = engine.tokenizer
    requests = workload.materialize(len(tok), sorted(engine.eos_token_ids), tokenize=lambda s: tok.encode(s))
    warm_up(engine)
    for rep in range(args.repeats):
        steps, reqs = replay(engine, requests, StepCost() if args.simulate else None, args.clock == "cpu",
                             args.until)
        summary = report(args, steps, reqs)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "steps": steps, "requests": reqs}))


def report(args, steps: list[dict], reqs: dict[str, dict]) -> dict:
    done = [q for q in reqs.values() if "done" in q]
    wall = max(q["done"] for q in done)
    tokens = sum(q["output"] for q in done)
    summary = {"sets": args.set, "clock": args.clock, "wall_s": wall, "tok_s": tokens / wall,
               "num_steps": len(steps), "classes": breakdown(steps, reqs)}
    if args.until:
        summary["phase"] = phase_steps(steps, wall)
    for cls, b in summary["classes"].items():
        last = b["last"]
        print(f"{cls:6} n={b['n']:3}  latency p50 {b['latency_s_p50']:.2f} p99 {b['latency_s_p99']:.2f} "
              f"max {b['latency_s_max']:.2f} s | "
              f"p50 wait {b['wait_s_p50']:.2f} prefill {b['prefill_s_p50']:.2f} decode {b['decode_s_p50']:.2f} | "
              f"last: {last['id']} out={last['output']} wait {last['wait_s']:.2f} "
              f"prefill {last['prefill_s']:.2f}/{last['prefill_steps']} steps "
              f"decode {last['decode_s']:.2f}/{last['decode_steps']} steps "
              f"({1000 * last['decode_s'] / max(1, last['decode_steps']):.0f} ms a step)")
    print(f"{args.clock} {wall:.2f} s, {summary['tok_s']:.1f} tok/s, {len(steps)} steps")
    for kind, k in summary.get("phase", {}).items():
        print(f"   {kind:7s} steps {k['steps']:3d} {k['s']:.2f} s ({1e3 * k['s'] / k['steps']:.1f} ms a step), "
              f"prefill tokens {k['prefill_tokens']}, decode rows {k['rows']}")
    return summary


if __name__ == "__main__":
    main()

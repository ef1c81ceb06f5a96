"""`gpuserv bench sweep`: decode throughput against batch size, the plateau, and max_num_seqs.

For each batch size B the sweep runs B sequences of `prompt_tokens` random
tokens on an in-process engine and times the decode steps that carry exactly
B decode tokens and nothing else (decode-heavy). It then repeats B with a
prefill chunk of `prefill_chunk` tokens riding in every step (prefill-heavy:
new prompts keep arriving, as in a mix with long prompts). Throughput is B /
median step time, in decode tokens per second.

The plateau is the smallest measured batch whose throughput reaches
`plateau_share` (90%) of the best measured: past it a bigger batch buys at
most 10% more tokens while every request's time per token grows with the
step. The recommended `max_num_seqs` for each mix is its curve's plateau.
When the best throughput is at the largest batch and still grew by more than
10% from the previous point, there is no plateau within the range, and the
result says so.

The knee is the largest batch whose step still takes at most `knee_factor`
(1.25) times the batch-1 step: up to there batching is nearly free for every
request's time per token (the step is bound by reading the weights); past it
the step grows with the batch (bound by compute). It is the recommendation
when latency matters more than throughput, or when the throughput curve has
no plateau in the range (a CPU: bigger batches keep amortising per-step
overheads while each token takes longer).

The latest result per model is also kept at `$GPUSERV_HOME/sweeps/<model>.json`,
where the daemon's `batch_past_plateau` hint reads it (hints/sweeps.py).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from gpuservd.config import load_config
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.hints.sweeps import sweep_path

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
PLATEAU_SHARE = 0.9


def find_plateau(points: list[dict], share: float = PLATEAU_SHARE) -> dict:
    """points: [{"batch", "tokens_s"}] in batch order. Returns the plateau batch, its throughput, the best,
    and whether the curve really flattened inside the range."""
    if not points:
        raise ValueError("no sweep points")
    best = max(points, key=lambda p: p["tokens_s"])
    plateau = next(p for p in points if p["tokens_s"] >= share * best["tokens_s"])
    last = points[-1]
    prev = points[-2] if len(points) >= 2 else None
    still_growing = best is last and prev is not None and last["tokens_s"] > (2 - share) * prev["tokens_s"]
    return {"batch": plateau["batch"], "tokens_s": plateau["tokens_s"], "best_batch": best["batch"],
            "best_tokens_s": best["tokens_s"], "flattened": not still_growing}


KNEE_FACTOR = 1.25


def find_knee(points: list[dict], factor: float = KNEE_FACTOR) -> dict:
    """The largest batch whose step time is within `factor` of the smallest batch's (points in batch order)."""
    base = points[0]["step_ms"]
    knee = points[0]
    for p in points:
        if p["step_ms"] <= factor * base:
            knee = p
        else:
            break
    return {"batch": knee["batch"], "step_ms": knee["step_ms"], "tokens_s": knee["tokens_s"],
            "vs_smallest": round(knee["step_ms"] / base, 3), "factor": factor}


def _params(max_tokens: int):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def _prompt(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(100, max(101, vocab - 1), size=n).tolist()


def _measure(engine, batch: int, prompt_tokens: int, steps: int, chunk: int, rng, tag: str) -> dict:
    """Median step of `steps` steps with exactly `batch` decode tokens (and a `chunk`-token prefill when chunk)."""
    vocab = len(engine.tokenizer)
    first = engine.telemetry.num_steps
    # Long enough to outlast the measurement after the batch's own prefill (spread over several steps);
    # no longer, so that a sequence never holds (or is checked against) more than it will use.
    prefill_steps = -(-batch * prompt_tokens // engine.config.scheduler.max_prefill_tokens)
    max_tokens = min(engine.max_model_len - prompt_tokens, prefill_steps + 2 * steps + 16)
    for i in range(batch):
        engine.add_request(f"{tag}-{batch}-{i}", _prompt(rng, prompt_tokens, vocab), _params(max_tokens))
    feeder = 0
    good: list = []
    while len(good) < steps and engine.has_unfinished():
        if chunk and not engine.scheduler.waiting:
            feeder += 1  # a new prompt every step: one chunk of prefill rides with the decode batch
            engine.add_request(f"{tag}-{batch}-p{feeder}", _prompt(rng, chunk, vocab), _params(1))
        engine.step()
        rec = engine.telemetry.recent(1)[0]
        if rec.num_decode_tokens == batch and rec.num_prefill_tokens == chunk:
            good.append(rec)
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    if len(good) < steps:
        raise RuntimeError(f"batch {batch}: only {len(good)} clean steps in {engine.telemetry.num_steps - first}; "
                           "raise the KV cache or max_num_seqs")
    step_s = statistics.median(r.wall_s for r in good)
    return {"batch": batch, "step_ms": round(1000 * step_s, 6), "tokens_s": round(batch / step_s, 2),
            "forward_ms": round(1000 * statistics.median(r.forward_s for r in good), 3), "num_steps": len(good)}


def run_sweep(model: str, config_path: Path | None = None, batches=DEFAULT_BATCHES, prompt_tokens: int = 32,
              prefill_chunk: int = 256, steps: int = 8, out_dir: Path | None = None, save_latest: bool = True,
              log=print) -> dict:
    """Run the sweep, write result.json, result.md and sweep.png under out_dir; returns the result."""
    batches = sorted(set(int(b) for b in batches))
    if not batches or batches[0] < 1:
        raise ValueError("batch sizes must be >= 1")
    cfg = load_config(config_path)
    cfg.model = model
    top = batches[-1]
    s = cfg.scheduler
    # Room for the largest batch plus the prefilling prompt; the sweep measures the model, not the limits.
    s.max_num_seqs = top + 1
    s.max_prefill_tokens = max(s.max_prefill_tokens, prefill_chunk)
    s.max_num_batched_tokens = max(s.max_num_batched_tokens, top + prefill_chunk)
    cfg.preemption.mode = "off"
    t0 = time.perf_counter()
    engine = LLMEngine.from_store(model, cfg)
    need = top * -(-(prompt_tokens + steps + 64) // cfg.block_size) + -(-prefill_chunk // cfg.block_size) + 1
    if engine.pool.num_blocks < need:
        raise ValueError(f"the KV pool has {engine.pool.num_blocks} blocks; batch {top} needs about {need}: "
                         "raise engine.kv_cache_bytes in --config")
    log(f"{model}: loaded in {time.perf_counter() - t0:.1f} s; {torch.get_num_threads()} threads, {cfg.dtype}")
    rng = np.random.default_rng(0)
    _measure(engine, 2, prompt_tokens, 2, 0, rng, "warm")
    decode, mixed = [], []
    for b in batches:
        decode.append(_measure(engine, b, prompt_tokens, steps, 0, rng, "decode"))
        mixed.append(_measure(engine, b, prompt_tokens, steps, prefill_chunk, rng, "mixed"))
        log(f"  batch {b:4d}: decode {decode[-1]['tokens_s']:8.1f} tok/s ({decode[-1]['step_ms']:.1f} ms/step); "
            f"with a {prefill_chunk}-token prefill chunk {mixed[-1]['tokens_s']:8.1f} tok/s "
            f"({mixed[-1]['step_ms']:.1f} ms/step)")
    pd, pm = find_plateau(decode), find_plateau(mixed)
    result = {
        "model": model, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "dtype": cfg.dtype,
        "device": cfg.device, "num_threads": torch.get_num_threads(), "prompt_tokens": prompt_tokens,
        "prefill_chunk": prefill_chunk, "steps_per_point": steps, "plateau_share": PLATEAU_SHARE,
        "points": decode, "points_prefill_heavy": mixed, "plateau_batch": pd["batch"],
        "plateau": {"decode_heavy": pd, "prefill_heavy": pm},
        "recommended": {"decode_heavy": pd["batch"], "prefill_heavy": pm["batch"]},
        "knee": {"decode_heavy": find_knee(decode), "prefill_heavy": find_knee(mixed)},
        "config": str(config_path) if config_path else None,
    }
    out_dir = Path(out_dir or Path("bench/runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-sweep-{model}")
    write_sweep(out_dir, result)
    if save_latest:
        path = sweep_path(model)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
    log(f"wrote {out_dir}/result.json, result.md, sweep.png")
    return result


def markdown(r: dict) -> str:
    pd, pm = r["plateau"]["decode_heavy"], r["plateau"]["prefill_heavy"]
    lines = [f"# Batch-size sweep: {r['model']} ({r['dtype']}, {r['device']}, {r['num_threads']} threads)", "",
             f"{r['date']}; prompts of {r['prompt_tokens']} tokens; median of {r['steps_per_point']} steps per "
             f"point; prefill-heavy steps also carry a {r['prefill_chunk']}-token prefill chunk.", "",
             "| batch | decode-heavy tok/s | step ms | prefill-heavy tok/s | step ms |", "|---|---|---|---|---|"]
    for d, m in zip(r["points"], r["points_prefill_heavy"]):
        lines.append(f"| {d['batch']} | {d['tokens_s']:.1f} | {d['step_ms']:.1f} | {m['tokens_s']:.1f} | "
                     f"{m['step_ms']:.1f} |")
    lines.append("")
    for name, p in (("decode-heavy", pd), ("prefill-heavy", pm)):
        note = "" if p["flattened"] else " (still growing at the largest batch: no plateau in this range)"
        lines.append(f"- {name}: plateau at batch {p['batch']} ({p['tokens_s']:.1f} tok/s, "
                     f">= {int(100 * r['plateau_share'])}% of the best {p['best_tokens_s']:.1f} at batch "
                     f"{p['best_batch']}){note}; recommended `max_num_seqs: {p['batch']}`")
    for name, key in (("decode-heavy", "decode_heavy"), ("prefill-heavy", "prefill_heavy")):
        k = (r.get("knee") or {}).get(key)
        if k:
            lines.append(f"- {name} knee: batch {k['batch']} ({k['step_ms']:.1f} ms/step, {k['vs_smallest']}x the "
                         f"smallest batch's step): up to here batching costs no latency; `max_num_seqs: "
                         f"{k['batch']}` when time per token matters more than throughput")
    return "\n".join(lines) + "\n"


def write_sweep(out_dir: Path, r: dict) -> None:
    import matplotlib  # only when a plot is drawn: importing it takes about a second

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after use("Agg"): pyplot fixes its backend when imported

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "result.json").write_text(json.dumps(r, indent=2))
    (out_dir / "result.md").write_text(markdown(r))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label, plateau in (("points", "decode-heavy", r["plateau"]["decode_heavy"]),
                                ("points_prefill_heavy", f"prefill-heavy (+{r['prefill_chunk']}-token chunk)",
                                 r["plateau"]["prefill_heavy"])):
        xs = [p["batch"] for p in r[key]]
        line, = ax.plot(xs, [p["tokens_s"] for p in r[key]], marker="o", label=label)
        ax.axvline(plateau["batch"], color=line.get_color(), linestyle="--", alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("decode batch (sequences)")
    ax.set_ylabel("decode tokens / s")
    ax.set_title(f"{r['model']}: decode throughput by batch size (dashed: plateau)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "sweep.png", dpi=110)
    plt.close(fig)

#!/usr/bin/env python3
"""Swap copies beside the forward on CUDA (issue 3): does a swap-out's device -> host copy hide behind
the step that follows it?

    python scripts/bench_swap_overlap.py [--model isolation-small] [--dtype bfloat16] [--batch 32]
                                         [--context 512] [--victim-tokens 4096] [--iters 30] [--out DIR]

One engine on cuda:0 (SmolLM2's shape with random weights by default). A decode step of --batch sequences
at --context tokens each is timed (wall clock around enqueue + the logits' copy to the host, which is how
the engine's step ends) four ways, medians over --iters, interleaved:
  forward   the step alone
  swap      one swap-out of a --victim-tokens request (every layer to the host), execute + finish
  serial    swap-out, wait for it, then the step (what the engine did before: copies, then the forward)
  overlap   swap-out enqueued, the step, then finish() (what the engine does now)
Hidden = (serial - overlap) / swap. Writes result.json and result.md under --out. On a machine without
CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--model", default="isolation-small")
    a.add_argument("--dtype", default="bfloat16")
    a.add_argument("--batch", type=int, default=32)
    a.add_argument("--context", type=int, default=512)
    a.add_argument("--victim-tokens", type=int, default=4096)
    a.add_argument("--iters", type=int, default=30)
    a.add_argument("--out", type=Path, default=None)
    a.add_argument("--device", default="cuda:0", help="cuda:N (cpu only checks that the script runs)")
    args = a.parse_args()
    import torch

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    from gpuservd.bench.random_model import RANDOM_MODELS, ensure_random_llama
    from gpuservd.config import EngineConfig, PreemptionConfig
    from gpuservd.engine.engine import LLMEngine
    from gpuservd.kv_cache.cache import cache_shape
    from gpuservd.kv_cache.swap import KVMove
    from gpuservd.runner.model_config import load_arch
    from gpuservd.runner.batch import SeqChunk
    from gpuservd.store.store import ModelStore

    store = ModelStore()
    if args.model in RANDOM_MODELS:
        ensure_random_llama(store, args.model, RANDOM_MODELS[args.model], tokenizer_from="smollm2")
    bs = 16
    per_seq = -(-(args.context + 1) // bs)
    victim_blocks = -(-args.victim_tokens // bs)
    block_bytes = cache_shape(load_arch(store.path(args.model)), bs, getattr(torch, args.dtype)).bytes_per_block
    cfg = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, block_size=bs,
                       kv_cache_bytes=(args.batch * per_seq + victim_blocks + 8) * block_bytes,
                       preemption=PreemptionConfig(swap_space_bytes=(victim_blocks + 8) * block_bytes))
    eng = LLMEngine(args.model, store.path(args.model), cfg)
    pool, host, swapper, runner = eng.pool, eng.host_pool, eng.swapper, eng.runner
    L = runner.cache.shape.num_layers
    tables = [pool.allocate(per_seq) for _ in range(args.batch)]
    chunks = [SeqChunk([100 + i], args.context, t, True) for i, t in enumerate(tables)]
    victim, hblocks = pool.allocate(victim_blocks), host.allocate(victim_blocks)
    runner.cache.kv.normal_()

    def forward():
        logits = runner.execute(chunks)
        logits.argmax(-1).tolist()  # the engine's step ends on the sampled ids reaching the host

    def move():
        return [KVMove("victim", "out", victim, hblocks, L)]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    def swap_only():
        swapper.execute(move())
        swapper.finish()

    def serial():
        swap_only()
        forward()

    def overlap():
        swapper.execute(move())
        forward()
        swapper.finish()

    ways = {"forward": forward, "swap": swap_only, "serial": serial, "overlap": overlap}
    for fn in ways.values():  # warm-up: kernels, pinned pages, the allocator
        for _ in range(3):
            timed(fn)
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.iters):
        for k, fn in ways.items():
            times[k].append(timed(fn))
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    copy_bytes = victim_blocks * block_bytes
    result = {
        "device": torch.cuda.get_device_name(args.device) if cuda else "cpu", "torch": torch.__version__, "model": args.model,
        "dtype": args.dtype, "batch": args.batch, "context": args.context, "victim_tokens": args.victim_tokens,
        "victim_bytes": copy_bytes, "iters": args.iters, "median_ms": med,
        "swap_gbps": copy_bytes / (med["swap"] / 1000) / 1e9,
        "hidden_share": (med["serial"] - med["overlap"]) / med["swap"] if med["swap"] > 0 else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "method": "wall clock around each way with torch.cuda.synchronize() before and after; medians, interleaved",
    }
    md = "\n".join([
        f"# swap-out beside the forward: {result['device']}, {args.dtype}, decode batch {args.batch} x "
        f"{args.context} tokens, victim {args.victim_tokens} tokens ({copy_bytes / 1e6:.0f} MB)", "",
        "| way | median ms |", "|---|---|", *[f"| {k} | {v:.2f} |" for k, v in med.items()], "",
        f"Swap-out alone moves {result['swap_gbps']:.1f} GB/s. Serial - overlap = {med['serial'] - med['overlap']:.2f} ms, "
        f"{100 * (result['hidden_share'] or 0):.0f}% of the swap's time hidden behind the step.", "",
        f"{result['date']}, torch {torch.__version__}; {result['method']}.", ""])
    print(md)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=2))
        (args.out / "result.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

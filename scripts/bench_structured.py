#!/usr/bin/env python3
"""What structured output costs: decode throughput of a batch with half its requests under a JSON schema,
against the same batch unconstrained.

    python scripts/bench_structured.py [--model smollm2] [--batch 32] [--max-tokens 64] [--rounds 3]
                                       [--temperature 0.7] [--device cpu] [--out DIR]

One engine from the store. Each round runs --batch requests together twice, interleaved: all
unconstrained, then the same prompts with every other one under a JSON schema: an array of at least
--max-tokens records (an integer and an enum each), which no request can complete, so every request
generates exactly --max-tokens tokens either way and the two batches have the same shape at every
step. The difference is what the masks cost: llguidance filling the constrained rows' bitmask, the
sampler applying it, the matchers advancing. The step times are wall time; the *_cpu_step_ms keys are
the process's CPU time per step (all its threads), steadier than wall time on a shared machine.
Prints one JSON line; writes result.json under --out when given.
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


def _run(engine, prompts, params_for) -> tuple[int, float, int, float]:
    """(tokens generated, seconds, steps, CPU seconds) for the prompts run together to the end."""
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for i, (rid, p) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, p, params_for(i))
    tokens, steps = 0, 0
    t0, c0 = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    return tokens, time.perf_counter() - t0, steps, time.process_time() - c0


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--model", default="smollm2")
    a.add_argument("--batch", type=int, default=32)
    a.add_argument("--max-tokens", type=int, default=64)
    a.add_argument("--rounds", type=int, default=3)
    a.add_argument("--temperature", type=float, default=0.7, help="0: greedy (plain rows take the argmax alone)")
    a.add_argument("--device", default="cpu")
    a.add_argument("--out", type=Path, default=None)
    args = a.parse_args()

    from gpuservd.config import EngineConfig
    from gpuservd.engine.engine import LLMEngine
    from gpuservd.engine.request import GuidedSpec, SamplingParams

    engine = LLMEngine.from_store(args.model, EngineConfig(model=args.model, device=args.device))
    tok = engine.tokenizer
    prompts = [tok.encode(f"Record number {i}: describe it as JSON.") for i in range(args.batch)]
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1, ignore_eos=True,
                           detokenize=True)

    record = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tag": {"enum": ["red", "green", "blue"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    schema = {"type": "array", "items": record, "minItems": args.max_tokens}
    spec = GuidedSpec("json_schema", json.dumps(schema), "bench")

    def mixed(i: int) -> SamplingParams:
        return SamplingParams(**vars(plain)) if i % 2 else SamplingParams(**{**vars(plain), "guided": spec})

    _run(engine, prompts[:2], mixed)  # warm: kernels, the grammar tokenizer
    rates: dict[str, list[float]] = {"plain": [], "mixed": []}
    steps: dict[str, list[float]] = {"plain": [], "mixed": []}
    cpu: dict[str, list[float]] = {"plain": [], "mixed": []}
    for _ in range(args.rounds):
        for name, fn in (("plain", lambda i: SamplingParams(**vars(plain))), ("mixed", mixed)):
            n, s, k, c = _run(engine, prompts, fn)
            rates[name].append(n / s)
            steps[name].append(s / k)
            cpu[name].append(c / k)
    plain_rate, mixed_rate = statistics.median(rates["plain"]), statistics.median(rates["mixed"])
    result = {"model": args.model, "device": args.device, "batch": args.batch, "max_tokens": args.max_tokens,
              "temperature": args.temperature,
              "plain_tok_s": round(plain_rate, 1), "mixed_tok_s": round(mixed_rate, 1),
              "plain_step_ms": round(1000 * statistics.median(steps["plain"]), 2),
              "mixed_step_ms": round(1000 * statistics.median(steps["mixed"]), 2),
              "step_cost_pct": round(100 * (statistics.median(steps["mixed"]) / statistics.median(steps["plain"]) - 1),
                                     1),
              "plain_cpu_step_ms": round(1000 * statistics.median(cpu["plain"]), 2),
              "mixed_cpu_step_ms": round(1000 * statistics.median(cpu["mixed"]), 2)}
    print(json.dumps(result))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

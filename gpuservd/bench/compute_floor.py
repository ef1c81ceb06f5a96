"""The compute floor of each class's P99: how soon a class's requests could possibly be done on this CPU.

Every token a request puts through the model costs at least the multiply-adds of the decoder layers'
linear maps, and every token it samples those of the LM head: 2 FLOPs a weight. No server can run them
faster than the CPU's FMA peak (fma_peak.py, on all of its cores), so a request's work / peak is a lower
bound on its latency, and in a burst (every request of the class sent at once) the k-th of the class to
finish waited at least for the k smallest requests' work: the j-th smallest latency is at least
max(the j-th smallest request's work, the j + 1 smallest requests' work together) / peak. The P99, which
numpy interpolates between two neighbouring latencies, is then at least the same interpolation of these
bounds. Left out, so the floor stays below what any server can do: attention, norms and every other
operation, memory reads, and prompt tokens a request shares with another request (a prefix cache could
skip them). Where the CPU multiplies the dtype faster than fp32 FMAs (bf16 dot products with AVX512_BF16,
fp16 FMAs with AVX512_FP16: two multiply-adds a 32-bit lane) the peak counts twice; where it has AMX
tiles, which the probe does not measure, there is no floor.

The bench reports it beside the batch-1 decode floor (floor.py), as `floor.class_p99` in result.json.
"""

from __future__ import annotations

import math
import os
import subprocess

from gpuservd.bench.floor import decode_params
from gpuservd.bench.fma_peak import NoCompiler, fma_peak
from gpuservd.dtypes import cpu_flags

# Percentile of the floor (the report's headline latency percentile).
Q = 99


def unshared_prompt_tokens(prompts: list[list[int]]) -> list[int]:
    """Per prompt, its tokens past the longest prefix it shares with any other prompt: the tokens a
    prefix cache could not have computed for it elsewhere. The longest common prefix with any prompt is
    found among its neighbours in sorted order."""
    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    shared = [0] * len(prompts)

    def lcp(a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    for a, b in zip(order, order[1:]):
        n = lcp(prompts[a], prompts[b])
        shared[a], shared[b] = max(shared[a], n), max(shared[b], n)
    return [len(p) - s for p, s in zip(prompts, shared)]


def request_flops(unshared_prompt: int, output_tokens: int, layer_params: int, head_params: int) -> float:
    """FLOPs a request cannot avoid: its unshared prompt tokens and every output token but the last through
    the layers (the last is sampled, never fed back), every output token through the LM head."""
    out = max(1, int(output_tokens))
    return 2.0 * ((unshared_prompt + out - 1) * layer_params + out * head_params)


def percentile_floor(works: list[float], peak_flops: float, burst: bool, q: float = Q) -> float:
    """The lower bound of the q-th percentile (numpy's linear interpolation) of a class's latencies, from
    each request's FLOPs (`works`) at `peak_flops`."""
    w = sorted(works)
    bound, total = [], 0.0
    for x in w:
        total += x
        bound.append(max(x, total if burst else x) / peak_flops)
    k = q / 100 * (len(w) - 1)
    lo = int(math.floor(k))
    hi = min(lo + 1, len(w) - 1)
    return bound[lo] + (bound[hi] - bound[lo]) * (k - lo)


def best_rate(threads: int) -> float:
    """GFLOP/s: the probe's best wall or CPU-time rate (the higher one gives the lower, safer floor)."""
    p = fma_peak(threads)
    return max(p["gflops_wall"], p["gflops_cpu"])


def dtype_factor(dtype: str, flags: set[str]) -> tuple[float | None, str]:
    """(multiply-adds a 32-bit lane per FMA-rate instruction for `dtype` on this CPU, or None where the
    probe cannot bound it; why)."""
    if dtype in ("bfloat16", "float16") and ({"amx_bf16", "amx_fp16"} & flags):
        return None, f"the CPU has AMX tiles, which multiply {dtype} faster than the FMA probe measures"
    if (dtype == "bfloat16" and "avx512_bf16" in flags) or (dtype == "float16" and "avx512_fp16" in flags):
        return 2.0, f"{dtype} dot products do two multiply-adds a 32-bit lane: the fp32 FMA peak counted twice"
    return 1.0, "fp32 FMAs"


def class_p99_floor(requests, arch_config: dict, dtype: str, measure_peak=None, cores: int | None = None,
                    flags: set[str] | None = None) -> dict:
    """result.json's `floor.class_p99`: the FMA peak used and, per class, its P99 floor in seconds.
    `requests`: the bench's materialized requests (cls, arrival_s, prompt_token_ids, output_tokens).
    measure_peak(threads) -> GFLOP/s (default: best_rate)."""
    flags = cpu_flags() if flags is None else flags
    factor, why = dtype_factor(dtype, flags)
    if factor is None:
        return {"skipped": why}
    cores = cores or len(os.sched_getaffinity(0))
    try:
        probed = (measure_peak or best_rate)(cores)
    except (NoCompiler, OSError, subprocess.CalledProcessError) as exc:
        return {"skipped": f"the FMA probe could not run: {exc}"}
    peak = probed * factor * 1e9
    layer_params, head_params = decode_params(arch_config, biases=False)
    unshared = unshared_prompt_tokens([list(r.prompt_token_ids) for r in requests])
    by_class: dict[str, list] = {}
    for r, u in zip(requests, unshared):
        by_class.setdefault(r.cls, []).append((r, request_flops(u, r.output_tokens, layer_params, head_params)))
    classes = {}
    for cls, items in sorted(by_class.items()):
        burst = all(r.arrival_s <= 0 for r, _ in items)
        works = [w for _, w in items]
        classes[cls] = {"n": len(items), "burst": burst, "gflop": sum(works) / 1e9,
                        f"p{Q}_floor_s": percentile_floor(works, peak, burst)}
    return {"fma_peak_gflops": probed, "cores": cores, "dtype_factor": factor, "peak_note": why,
            "classes": classes}


def floor_lines(result: dict) -> list[str]:
    """Markdown: each class's P99 floor, and each system's P99 of that class over it."""
    fl = (result.get("floor") or {}).get("class_p99")
    if not fl:
        return []
    if fl.get("skipped"):
        return ["", f"Compute floor of each class's P{Q}: not computed ({fl['skipped']})."]
    parts, beat = [], []
    for cls, c in fl["classes"].items():
        floor_s = c[f"p{Q}_floor_s"]
        over = []
        for name, s in result["systems"].items():
            p = (s["latency_s"].get(cls) or {}).get(f"p{Q}")
            if p is not None and floor_s > 0:
                over.append(f"{name} {p / floor_s:.2f}x")
                if p < floor_s:
                    beat.append(f"{name} ({cls})")
        parts.append(f"{cls} {floor_s:.2f} s" + (f" ({', '.join(over)})" if over else ""))
    twice = " x 2: " + fl["peak_note"] if fl.get("dtype_factor", 1) != 1 else ""
    lines = ["", f"Compute floor of each class's P{Q}: " + "; ".join(parts) + f". Each request's multiply-adds in "
                 f"the linear layers and the LM head (prompt tokens no other request shares, output tokens) at this "
                 f"CPU's FMA peak, {fl['fma_peak_gflops']:.0f} GFLOP/s on {fl['cores']} cores{twice}; in a burst the "
                 "k-th request of a class to finish waited for the k smallest ones' work."]
    if beat:  # a floor is a lower bound: beaten, the probe read less than the CPU can do
        lines.append(f"Below the floor: {', '.join(beat)}. The FMA probe under-read this CPU's peak (a busy "
                     "machine while it ran), so these floors are not lower bounds here.")
    return lines

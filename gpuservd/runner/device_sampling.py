"""Sampling as fixed-shape tensor ops: the part of a step's token choice that can run on the device,
inside a CUDA graph, for a whole bucket at once.

A decode row that asks for nothing beyond temperature, top_k, top_p, min_p and its seed (no
penalties, bias, min_tokens, grammar or logprobs) is chosen here, beside the forward: every
row's parameters are device tensors (filled with the step's other inputs, one copy), every
decision is a tensor op (no `.item()`, no branch on a value), and the shapes depend only on
the bucket, so the same kernels replay for any mix of rows. Greedy rows (temperature 0) take the
argmax; the others draw. Then the chosen id is checked against the row's stop ids, and the two
are packed as [2, b] int64 so one small copy brings them to the host.

The result equals the engine's host sampler (engine/sampler.py) token for token on the same
rows: the same processing order (temperature, then min_p, top_k, top_p over the top-k
renormalized probabilities), the same counter-based uniform per row and the same two-level
inverse CDF (both are defined here and the host sampler imports them). Only the truncation is
done differently, to keep a fixed shape: one full sort of the vocabulary instead of the host's
top-k of the largest k asked (a full sort costs a few microseconds on a GPU, and no host
decision on k is needed); the kept tokens and their values are the same.

Random draws are counter-based: row r draws u = hash(seed_r, step_r), step_r = the tokens it has
generated, so its tokens depend on its own seed, logits and position only, never on the batch,
its padding or the row it sits in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
# Multipliers under 2**31 keep every product of a 32-bit value inside int64 (no overflow on any device).
_MIX = (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39)
# The inverse CDF's first level sums the probabilities over chunks of this many tokens (192 for a 49k vocabulary).
CDF_CHUNK = 256


@dataclass(frozen=True)
class RowSampling:
    """What one decode row needs to be sampled on the device (the engine builds it from the request)."""

    temperature: float  # 0 = greedy
    top_k: int  # 0 = off
    top_p: float  # 1 = off
    min_p: float  # 0 = off
    seed: int  # the request's seed (any 64-bit value; the low 63 bits are used)
    step: int  # tokens the request has generated so far: the draw's counter


def _mix32(x):
    """A 32-bit integer hash (xorshift-multiply rounds) of int64 tensors holding values < 2**32 (or of a
    Python int: the same operators, the same result)."""
    for m in _MIX:
        x = x ^ (x >> 16)
        x = (x * m) & _M32
    return x ^ (x >> 15)


def _uniform_bits(seed, step):
    """The draw of uniform() before the scaling: 53 bits from (seed, step), int64 tensors or Python ints."""
    lo, hi = seed & _M32, (seed >> 32) & _M32
    h = _mix32(_mix32(lo ^ _mix32(hi)) ^ (step & _M32))
    h2 = _mix32(h ^ 0x5BD1E995)
    return (h << 21) | (h2 >> 11)


def uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One number in (0, 1) per row (float64), a pure function of (seed, step): seeds, steps int64 [R].
    On the CPU the rows are hashed as Python ints: the same integer steps and the same float64 rounding
    (bits < 2**53 convert exactly), so the same numbers, without the ~25 tensor ops (~0.2 ms a step)."""
    if seeds.device.type == "cpu":
        return torch.tensor([(_uniform_bits(s, t) + 0.5) / float(1 << 53)
                             for s, t in zip(seeds.tolist(), steps.tolist())], dtype=torch.float64)
    return uniform_tensor(seeds, steps)


def uniform_tensor(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """uniform() as tensor arithmetic on the seeds' device (inside a CUDA graph too)."""
    return (_uniform_bits(seeds, steps).to(torch.float64) + 0.5) / float(1 << 53)


def inverse_cdf(e: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token where the running sum of e [R, V] (probabilities) passes u [R] (float64, in (0, 1)) times
    the row's sum: chunk sums locate the chunk, then that chunk alone is summed token by token (no
    [R, V] cumulative sum or float64 copy). May return V or a token of probability 0 when rounding
    lands at the very top of the CDF: the caller takes the argmax then."""
    R, V = e.shape
    C = CDF_CHUNK
    n = -(-V // C)
    padded = e if V == n * C else torch.nn.functional.pad(e, (0, n * C - V))
    chunks = padded.view(R, n, C)
    ccdf = torch.cumsum(chunks.sum(-1).double(), dim=-1)  # [R, n]
    target = u * ccdf[:, -1]
    ci = torch.searchsorted(ccdf, target.unsqueeze(1), right=True).squeeze(1).clamp(max=n - 1)
    before = ccdf.gather(1, (ci - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    before = torch.where(ci > 0, before, torch.zeros_like(before))
    inner = torch.cumsum(chunks[torch.arange(R, device=e.device), ci].double(), dim=-1)  # [R, C]
    j = torch.searchsorted(inner, (target - before).unsqueeze(1), right=True).squeeze(1).clamp(max=C - 1)
    return ci * C + j


def nucleus(x: torch.Tensor, vals: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor):
    """The top_k and top_p cut over candidates `vals` [R, k]: x's k largest per row, sorted descending
    (k may be the whole vocabulary). Returns (vals with the tokens past a row's top_k at -inf, the tokens
    kept [R, k] bool, the running sum of their probabilities [R, k]). Shared by this sampler and the
    host's (engine/sampler.py), so both cut the same tokens."""
    k = vals.shape[1]
    pos = torch.arange(k, device=vals.device).unsqueeze(0)
    has_k, has_p = top_k > 0, top_p < 1.0
    k_row = torch.where(has_k, top_k.clamp(max=k), torch.full_like(top_k, k)).unsqueeze(1)
    vals = vals.masked_fill(pos >= k_row, float("-inf"))
    # Probabilities renormalized over the top-k for rows with top_k, over the whole vocabulary otherwise.
    lse = torch.where(has_k, torch.logsumexp(vals, -1), torch.logsumexp(x, -1)).unsqueeze(1)
    sp = torch.exp(vals - lse)
    cum = torch.cumsum(sp, dim=-1)
    # The nucleus: the shortest prefix reaching top_p (the first token always stays). A row without
    # top_p keeps every token: where float32's running sum reaches 1.0 before the tail, `cum - sp < 1`
    # would drop the tail, and only when another row of the batch had asked for top_p.
    keep = ((cum - sp < top_p.unsqueeze(1)) | ~has_p.unsqueeze(1)) & (pos < k_row)
    return vals, keep, cum


def truncate(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """min_p, top_k and top_p over x [R, V] (after temperature) with per-row parameters (top_k int64 [R],
    0 = off; top_p, min_p float32 [R]); dropped tokens become -inf. Fixed shape: one full sort."""
    neg = float("-inf")
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), neg)
    vals, ids = torch.sort(x, dim=-1, descending=True)  # [R, V]
    vals, keep, _ = nucleus(x, vals, top_k, top_p)
    return torch.full_like(x, neg).scatter_(1, ids, vals.masked_fill(~keep, neg))


def choose(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The chosen token [R] int64 of every row of logits [R, V] (fp32): the argmax where temperature is 0,
    else a draw from the processed distribution at the row's counter-based uniform. No host sync."""
    greedy = temperature == 0
    x = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    x = truncate(x, top_k, top_p, min_p)
    best = torch.argmax(x, dim=-1)
    probs = torch.softmax(x, dim=-1)
    drawn = inverse_cdf(probs, uniform(seeds, steps))
    V = x.shape[1]
    ok = (drawn < V) & (probs.gather(1, drawn.clamp(max=V - 1).unsqueeze(1)).squeeze(1) > 0)
    return torch.where(greedy | ~ok, best, drawn)


def stop_hits(ids: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """[R] int64: 1 where ids[r] is one of stop_ids[r] (int64 [R, S], -1 = none)."""
    return (ids[:, None] == stop_ids).any(-1).to(torch.int64)

"""The batched sampler: one token per row of a step's logits, every row of the batch at once.

Rows whose request is plain greedy (no penalty, bias, mask or logprobs) take
one argmax over the batch (the CPU kernel where there is one). Every other row
goes through the same tensor ops together, in this order:

1. logit_bias is added (OpenAI: "added to the logits prior to sampling");
2. min_tokens: EOS and the stop token ids get -inf until enough tokens are out
   (not for grammar rows: there the grammar decides when the output may end);
3. the allowed-token bitmask (grammars) sets -inf on every token it forbids;
4. repetition_penalty (vLLM's): a logit of a token in the prompt or the output
   is divided by it when positive and multiplied by it when negative;
5. frequency and presence penalties (OpenAI's), over the generated tokens:
   logit -= count * frequency_penalty + (count > 0) * presence_penalty;
6. temperature (greedy rows keep 1), then min_p, top_k and top_p truncation
   (top_p over the top-k renormalized probabilities, as transformers does).

Logprobs are the log-softmax of the logits after all six: the distribution the
token was actually drawn from, truncation and temperature included (vLLM's
`processed_logprobs`; vLLM's default instead returns the raw model's). Greedy
rows report the same processed logits at temperature 1, since a temperature of
0 has no distribution. Tokens outside the truncation have logprob -inf. They
are computed only for the rows that ask.

What a step costs here matters at batch 32 over a 49k vocabulary (6 MB of
logits a pass), so the rows are processed in place in one copy, in a handful
of passes. The allowed-token bitmask is unpacked with numpy's `unpackbits` (a
byte a token, no int32 expansion) and applied in place to the constrained rows
only. The inverse CDF is taken in two levels (runner/device_sampling.py's
inverse_cdf): chunk sums locate the chunk, and only that chunk is summed token
by token in float64, so no [R, V] cumulative sum or float64 copy is made.

Random draws are counter-based, not stateful generators: row r draws one
uniform number u = hash(seed_r, step_r), step_r = the tokens it has generated,
and takes the token where the cumulative distribution passes u (inverse CDF).
So a request's tokens depend only on its own seed, logits and position, never
on which other requests share the batch, on preemption and recompute, or on the
order rows happen to be in; the hash is integer tensor arithmetic over the
batch, so the same code runs on CUDA (and inside a CUDA graph) with no host
round trip and no per-row loop. SGLang's `multinomial_with_seed` takes the same
approach (with Gumbel noise over the whole vocabulary; one draw per row is
cheaper on a CPU). The hash and the inverse CDF live in runner/device_sampling.py,
which also chooses the plain-sampling rows of a fixed-shape decode step on the
device (inside its CUDA graph); this sampler and that one give the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpuservd.engine.request import Request
from gpuservd.runner import cpu_kernels
from gpuservd.runner.device_sampling import inverse_cdf, nucleus, uniform

# Rows without top_k look for their top_p nucleus among this many most likely tokens first (a top-k
# instead of a full sort of the vocabulary); a row whose nucleus is larger is sorted in full.
NUCLEUS_CANDIDATES = 1024


@dataclass
class TokenLogprobs:
    """The logprob of one sampled token and the most likely alternatives, from the processed logits."""

    token_id: int  # the token sampled
    logprob: float  # its logprob (-inf possible only for a token forced by a mask)
    top: list[tuple[int, float]]  # the N most likely (token id, logprob), N = params.logprobs


@dataclass
class SamplerOutput:
    """One step's choices, row by row in the order of the requests passed in."""

    token_ids: list[int]  # the sampled token per row
    logprobs: list[TokenLogprobs | None]  # per row; None where the request did not ask


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, -1), through the CPU kernel where there is one (torch's read SmolLM2's
    [64, 49152] logits at ~2 GB/s: 1.5 ms of a decode step)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        ops = cpu_kernels.get()
        if ops is not None:
            return ops.argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def _forbidden(bitmask: torch.Tensor, vocab: int, device: torch.device) -> torch.Tensor:
    """bitmask int32 [R, W] (bit j of word w allows token 32 w + j) -> forbidden bool [R, vocab] on device;
    ids past the grammar's vocabulary are never allowed."""
    if bitmask.device.type == "cpu" and device.type == "cpu":
        # numpy unpacks bits straight to bytes; an int32 word's bits j are in its little-endian bytes j // 8.
        words = bitmask.contiguous().numpy().astype("<i4", copy=False)
        bits = np.unpackbits(np.invert(words.view(np.uint8)), axis=1, bitorder="little")
        forbidden = torch.from_numpy(bits).view(torch.bool)
    else:
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        forbidden = ((bitmask.to(device).unsqueeze(-1) >> shifts) & 1).eq(0).reshape(bitmask.shape[0], -1)
    if forbidden.shape[1] >= vocab:
        return forbidden[:, :vocab]
    pad = torch.ones(forbidden.shape[0], vocab - forbidden.shape[1], dtype=torch.bool, device=forbidden.device)
    return torch.cat([forbidden, pad], dim=1)


def _apply_mask(x: torch.Tensor, bitmask: torch.Tensor, masked: list[bool]) -> None:
    """-inf in place on every token a constrained row's bitmask forbids (x: [R, V]); other rows untouched."""
    idx = [i for i, m in enumerate(masked) if m]
    if not idx:
        return
    if len(idx) == len(masked):
        x.masked_fill_(_forbidden(bitmask, x.shape[1], x.device), float("-inf"))
        return
    forbidden = _forbidden(bitmask[torch.tensor(idx, device=bitmask.device)], x.shape[1], x.device)
    if x.device.type == "cpu":
        for k, i in enumerate(idx):  # a view per row: no gather and scatter of whole rows
            x[i].masked_fill_(forbidden[k], float("-inf"))
    else:
        rows = torch.tensor(idx, device=x.device)
        x[rows] = x[rows].masked_fill(forbidden, float("-inf"))

def _padded(rows: list[list[int]], pad: int, device) -> torch.Tensor:
    """Token id lists -> int64 [R, max len] padded with `pad` (at least one column)."""
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _apply_bias_and_min_tokens(x: torch.Tensor, reqs: list[Request], eos_ids, masked: list[bool]) -> None:
    rows, cols, vals = [], [], []
    banned_rows, banned_cols = [], []
    for i, r in enumerate(reqs):
        p = r.params
        for tok, bias in p.logit_bias.items():
            rows.append(i)
            cols.append(tok)
            vals.append(float(bias))
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens and not masked[i]:
            ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            banned_rows += [i] * len(ends)
            banned_cols += sorted(ends)
    if rows:
        x.index_put_((torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)),
                     torch.tensor(vals, dtype=x.dtype, device=x.device), accumulate=True)
    if banned_rows:
        x[torch.tensor(banned_rows, device=x.device), torch.tensor(banned_cols, device=x.device)] = float("-inf")


def _apply_penalties(x: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """Repetition, then frequency and presence penalties, on the rows that have any (x: [R, V])."""
    idx = [i for i, r in enumerate(reqs) if r.params.penalized]
    if not idx:
        return x
    R, V = len(idx), x.shape[1]
    dev = x.device
    sub = [reqs[i] for i in idx]
    rows = torch.tensor(idx, device=dev)
    y = x[rows]
    out = _padded([r.output_token_ids for r in sub], V, dev)
    counts = torch.zeros(R, V + 1, dtype=x.dtype, device=dev).scatter_add_(1, out, torch.ones_like(out, dtype=x.dtype))
    counts = counts[:, :V]
    rep = torch.tensor([r.params.repetition_penalty for r in sub], dtype=x.dtype, device=dev).unsqueeze(1)
    if any(r.params.repetition_penalty != 1.0 for r in sub):
        prompt = _padded([r.prompt_token_ids for r in sub], V, dev)
        seen = torch.zeros(R, V + 1, dtype=torch.bool, device=dev).scatter_(1, prompt, True)[:, :V] | (counts > 0)
        y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    freq = torch.tensor([r.params.frequency_penalty for r in sub], dtype=x.dtype, device=dev).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in sub], dtype=x.dtype, device=dev).unsqueeze(1)
    y = y - counts * freq - (counts > 0).to(x.dtype) * pres
    x[rows] = y
    return x


def _truncate(x: torch.Tensor, params: list) -> torch.Tensor:
    """min_p, top_k and top_p over x [R, V] (after temperature), one row per SamplingParams; dropped tokens
    become -inf. Which steps run is decided from the params on the host (no device sync); only a top_p row
    whose nucleus is larger than the candidates looked at costs one (then the whole vocabulary is sorted)."""
    R, V = x.shape
    neg = float("-inf")
    dev = x.device
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev)
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(-1, keepdim=True), neg)
    if not any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        return x
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=dev)
    has_k, has_p = top_k > 0, top_p < 1.0
    want = max(p.top_k for p in params)
    p_only = any(p.top_p < 1.0 and not p.top_k for p in params)
    if p_only:
        want = max(want, NUCLEUS_CANDIDATES)
    for k in (min(V, want), V):
        vals, ids = torch.topk(x, k, dim=-1)  # sorted, descending: [R, k]
        vals, keep, cum = nucleus(x, vals, top_k, top_p)
        if k == V or not p_only or bool((has_k | ~has_p | (cum[:, -1] >= top_p)).all()):
            break
    out = torch.full_like(x, neg).scatter_(1, ids, vals.masked_fill(~keep, neg))
    # A row with neither top_k nor top_p keeps its whole vocabulary: the candidates above are only the k
    # most likely that another row of the batch asked for.
    if all(p.top_k > 0 or p.top_p < 1.0 for p in params):  # decided from the params: no device sync
        return out
    return torch.where((has_k | has_p).unsqueeze(1), out, x)


def _choose(x: torch.Tensor, greedy: list[bool], seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """The chosen tokens [R] for the processed logits x [R, V]: greedy rows take the argmax; the others the
    inverse CDF at their counter-based uniform."""
    best = _argmax(x) if any(greedy) else None
    if all(greedy):
        return best
    # softmax's own vectorized exp, not torch.exp: the latter (MKL's) takes a slow path for every -inf,
    # and a grammar or top-k row is almost all -inf (4x the time at batch 16 x 49k).
    probs = torch.softmax(x, dim=-1)  # [R, V]
    drawn = inverse_cdf(probs, uniform(seeds, steps))
    # Rounding at the very top of the CDF could land on a token of probability 0 (or in the padding):
    # take the best then.
    V = x.shape[1]
    ok = (drawn < V) & (probs.gather(1, drawn.clamp(max=V - 1).unsqueeze(1)).squeeze(1) > 0)
    if best is None and not bool(ok.all()):
        best = _argmax(x)
    if best is None:
        return drawn
    keep = torch.tensor(greedy, device=x.device) | ~ok
    return torch.where(keep, best, drawn)


def _process(x: torch.Tensor, reqs: list[Request], eos_ids, bitmask: torch.Tensor | None,
             masked: list[bool]) -> torch.Tensor:
    """The processed logits of the non-plain rows, computed in place in x [R, V] (a copy of their logits)."""
    _apply_bias_and_min_tokens(x, reqs, eos_ids, masked)
    if bitmask is not None:
        _apply_mask(x, bitmask, masked)
    x = _apply_penalties(x, reqs)
    params = [r.params for r in reqs]
    if any(p.temperature and p.temperature != 1.0 for p in params):
        temps = torch.tensor([p.temperature or 1.0 for p in params], dtype=x.dtype, device=x.device)
        x.div_(temps.unsqueeze(1))
    return _truncate(x, params)


def _gather_logprobs(x: torch.Tensor, chosen: torch.Tensor, reqs: list[Request]) -> list[TokenLogprobs | None]:
    """Logprobs (the log-softmax of the processed logits x [R, V]) for the rows that asked, and only those."""
    idx = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(reqs)
    if not idx:
        return out
    rows = torch.tensor(idx, device=x.device)
    logprobs = torch.log_softmax(x[rows], dim=-1)  # [L, V]
    ids = chosen[rows]
    picked = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    want = [reqs[i].params.logprobs for i in idx]
    top_vals: list = [[]] * len(idx)
    top_ids: list = [[]] * len(idx)
    if max(want):
        vals, tops = torch.topk(logprobs, max(want), dim=-1)
        top_vals, top_ids = vals.tolist(), tops.tolist()
    ids_list = ids.tolist()
    for k, (i, w) in enumerate(zip(idx, want)):
        out[i] = TokenLogprobs(ids_list[k], picked[k], list(zip(top_ids[k][:w], top_vals[k][:w])))
    return out


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids=frozenset(),
           bitmask: torch.Tensor | None = None, masked: list[bool] | None = None,
           greedy_ids: torch.Tensor | None = None) -> SamplerOutput:
    """One token per row of logits [S, V] (fp32) for the matching requests.

    bitmask int32 [S, ceil(V'/32)] (V' the grammar's vocabulary) limits the rows where masked[row] is
    True to the tokens whose bit is set; other rows ignore their bitmask row. greedy_ids [S] (int64, on
    the logits' device): the rows' argmax where the forward already took it (inside a CUDA graph); the
    plain greedy rows then cost one small copy of ids to the host and no pass over the logits.
    """
    masked = masked or [False] * len(requests)
    plain = [r.params.plain_greedy and not m for r, m in zip(requests, masked)]
    best = greedy_ids
    if all(plain):
        return SamplerOutput((best if best is not None else _argmax(logits)).tolist(), [None] * len(requests))
    chosen = None
    if any(plain):
        chosen = best.clone() if best is not None else _argmax(logits)
    idx = [i for i, p in enumerate(plain) if not p]
    rows = torch.tensor(idx, device=logits.device)
    sub = [requests[i] for i in idx]
    # Processed in place in a copy: the caller may sample the same logits again (engine/row_failures.py).
    whole = len(idx) == len(requests)
    x = logits.clone() if whole else logits[rows]
    sub_masked = [masked[i] for i in idx]
    sub_mask = None
    if bitmask is not None and any(sub_masked):
        sub_mask = bitmask if whole else bitmask[rows.to(bitmask.device)]
    x = _process(x, sub, eos_token_ids, sub_mask, sub_masked)
    seeds = torch.tensor([r.sample_seed & 0x7FFFFFFFFFFFFFFF for r in sub], dtype=torch.long, device=x.device)
    steps = torch.tensor([len(r.output_token_ids) for r in sub], dtype=torch.long, device=x.device)
    picked = _choose(x, [r.params.greedy for r in sub], seeds, steps)
    chosen = picked if chosen is None else chosen.index_copy(0, rows, picked.to(chosen.dtype))
    out_lp: list[TokenLogprobs | None] = [None] * len(requests)
    for i, lp in zip(idx, _gather_logprobs(x, picked, sub)):
        out_lp[i] = lp
    return SamplerOutput(chosen.tolist(), out_lp)

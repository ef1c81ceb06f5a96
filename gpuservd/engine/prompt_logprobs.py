"""Prompt logprobs: each prompt token's logprob under the model, from the prefill's logits.

The logits at position p predict the token at p + 1, so a prefill chunk over positions [s, s + n) gives the
logprobs of prompt tokens s + 1 .. s + n (the last of them only when the chunk does not end the prompt:
there the row is the sampled one and predicts the first output token). They are the raw model's
log-softmax, before any sampling parameter (vLLM's `prompt_logprobs` are the same): the prompt was not
sampled, so there is no processed distribution to report. The first prompt token has none (OpenAI's
echo gives it null).

A request asking for them computes its whole prompt: it skips the prefix cache's lookup (kv_cache/
manager.py), since a cached position has no logits. Positions are recorded once, in order, so a prefill
recomputed after a preemption does not record them twice.
"""

from __future__ import annotations

import torch

from gpuservd.engine.sampler import TokenLogprobs


def record(chunks, logits: torch.Tensor) -> None:
    """Append the prompt logprobs the step's all-logits rows give (logits [P, V]: the rows build_batch
    returned after the sampled ones, chunk by chunk) to their requests."""
    offset = 0
    for c in chunks:
        req = c.request
        if not req.wants_prompt_logits:
            continue
        n = c.num_tokens - (1 if c.sample else 0)
        rows = logits[offset:offset + n]
        offset += n
        first = c.start_pos + 1  # the position row 0 predicts
        if first != len(req.prompt_logprobs):  # positions already recorded (a recompute): skip them
            skip = len(req.prompt_logprobs) - first
            if skip < 0 or skip >= n:
                continue
            rows, first = rows[skip:], first + skip
        rows = rows[:max(0, req.num_prompt_tokens - first)]
        if not rows.shape[0]:
            continue
        targets = req.prompt_token_ids[first:first + rows.shape[0]]
        lp = torch.log_softmax(rows.float(), dim=-1)  # [n, V]
        picked = lp.gather(1, torch.tensor(targets, device=lp.device).unsqueeze(1)).squeeze(1).tolist()
        k = req.params.prompt_logprobs
        tops: list = [[]] * len(targets)
        if k:
            vals, ids = torch.topk(lp, k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
        req.prompt_logprobs += [TokenLogprobs(t, p, top) for t, p, top in zip(targets, picked, tops)]


def take(req, first: bool) -> list | None:
    """The request's prompt logprobs for its first output (first: it carries a token or ends it), else None."""
    if req.prompt_logprobs is None or req.prompt_logprobs_sent or not first:
        return None
    req.prompt_logprobs_sent = True
    return req.prompt_logprobs

"""A step's rows as the runner takes them: the scheduled chunks turned into SeqChunks, with what the
fixed-shape decode step needs to choose their tokens on the device (stop ids, sampling parameters).

A row is chosen on the device when its request asks for nothing the device sampler lacks: plain
greedy (the argmax) or plain sampling (temperature, top_k, top_p, min_p, a seed; no penalties,
logit_bias, min_tokens, grammar or logprobs). The sampling parameters are attached only when every
sampling row of the step qualifies: a step that needs the host sampler for one row samples all its
rows there (the device would draw the same tokens, so drawing twice is waste).
"""

from __future__ import annotations

from gpuservd.engine.request import Request, SamplingParams
from gpuservd.engine.schedule_output import ScheduledChunk
from gpuservd.runner.batch import SeqChunk
from gpuservd.runner.device_sampling import RowSampling


def device_chosen(p: SamplingParams) -> bool:
    """The device step can choose this request's token (greedy, or sampling without extras)."""
    return p.plain_greedy or p.plain_sampling


def stop_ids(req: Request, eos_token_ids) -> tuple[int, ...]:
    """The ids that end a request: what the fixed-shape step checks on the device."""
    p = req.params
    return tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(sorted(eos_token_ids)))


def row_sampling(req: Request) -> RowSampling | None:
    """The row's sampling parameters for the device sampler; None for greedy (the argmax)."""
    p = req.params
    if p.greedy:
        return None
    return RowSampling(p.temperature, p.top_k, p.top_p, p.min_p, req.sample_seed, len(req.output_token_ids))


def seq_chunks(chunks: list[ScheduledChunk], kv, eos_token_ids, on_device: bool) -> list[SeqChunk]:
    """The runner's view of the scheduled chunks; on_device: attach the device sampler's parameters."""
    if on_device:
        on_device = all(device_chosen(c.request.params) for c in chunks if c.sample)
    return [
        SeqChunk(
            c.request.token_slice(c.start_pos, c.num_tokens),
            c.start_pos,
            kv.table(c.request),
            c.sample,
            stop_ids(c.request, eos_token_ids) if c.num_tokens == 1 else (),
            sampling=row_sampling(c.request) if on_device and c.num_tokens == 1 and c.sample else None,
            all_logits=c.request.wants_prompt_logits,
        )
        for c in chunks
    ]

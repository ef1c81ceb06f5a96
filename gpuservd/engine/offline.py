"""Running an engine without a daemon: one request's outputs as they come, or a batch to completion (the
CLI's local mode, the benchmarks and the tests)."""

from __future__ import annotations

import time

from gpuservd.engine.request import SamplingParams


def stream(engine, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
    """Run one request (alongside whatever else is queued) and yield its RequestOutputs."""
    engine.add_request(request_id, prompt_token_ids, params)
    try:
        while True:
            for out in engine.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return
    finally:
        if request_id in engine.requests:  # the caller stopped early (Ctrl-C): free its blocks
            engine.abort(request_id)


def generate(engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Run prompts to completion together; returns the output token ids per prompt."""
    ids = [f"gen-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    results: dict[str, list[int]] = {i: [] for i in ids}
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(**vars(params)))
    while engine.has_unfinished():
        for out in engine.step():
            results[out.request_id].extend(out.new_token_ids)
    return [results[i] for i in ids]

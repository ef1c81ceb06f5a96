"""Sampling that fails one request, not the batch.

A step samples every request's next token in one batched call. When that call raises, the cause is
usually one request (a value validation let through, a grammar that no longer matches, a bias on a
token id the model does not have) and failing the whole step would cut every stream of the model
off. `RowFailures.sample` then samples each row on its own: the rows that raise alone are the
requests to fail, and the others get their tokens. The draws depend on each request's seed and
position only, so a row sampled alone gets the same token it would have in the batch. When no
single row raises, the fault is the batch's (a device error): the original exception goes up and
the step fails as before.
"""

from __future__ import annotations

import torch

from gpuservd.engine import sampler
from gpuservd.engine.request import Request
from gpuservd.engine.sampler import SamplerOutput


def _row(x: torch.Tensor | None, row: int) -> torch.Tensor | None:
    return None if x is None else x[row:row + 1]


class RowFailures:
    """The engine's sampler front: batched, falling back to one row at a time on a failure."""

    def __init__(self):
        self._failed: list[tuple[str, Exception]] = []

    def sample(self, logits: torch.Tensor, requests: list[Request], eos_token_ids, bitmask=None, masked=None,
               greedy_ids: torch.Tensor | None = None) -> SamplerOutput:
        """sampler.sample's arguments and result; a failed row's token id is None (its request is in
        take() afterwards and must be aborted by the caller)."""
        try:
            return sampler.sample(logits, requests, eos_token_ids, bitmask, masked, greedy_ids=greedy_ids)
        except Exception as batch_exc:
            tokens: list[int | None] = []
            logprobs: list = []
            failed: list[tuple[str, Exception]] = []
            for row, req in enumerate(requests):
                try:
                    one = sampler.sample(logits[row:row + 1], [req], eos_token_ids, _row(bitmask, row),
                                         None if masked is None else [masked[row]], greedy_ids=_row(greedy_ids, row))
                    tokens.append(one.token_ids[0])
                    logprobs.append(one.logprobs[0])
                except Exception as exc:
                    tokens.append(None)
                    logprobs.append(None)
                    failed.append((req.request_id, exc))
            if not failed:
                raise batch_exc
        self._failed += failed
        return SamplerOutput(tokens, logprobs)

    def fail(self, request_id: str, exc: Exception) -> None:
        """Fail one request from outside the sampler (the caller aborts it); reported by take() as a row."""
        self._failed.append((request_id, exc))

    def take(self) -> list[tuple[str, Exception]]:
        """(request id, exception) of every row that failed alone since the last call."""
        failed, self._failed = self._failed, []
        return failed

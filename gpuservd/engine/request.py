"""Requests, their sampling parameters and their lifecycle.

Only dataclasses cross layers: the engine hands `RequestOutput`s up to the CLI,
the bench and the daemon; the scheduler reads and updates `Request`s.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from gpuservd.errors import UserError


class RequestState(enum.IntEnum):
    """Lifecycle, ordered: every state after RUNNING is a pause or an end."""

    WAITING = 0  # queued, holds no KV blocks (or had them dropped by a preemption)
    RUNNING = 1  # in the batch: prefilling or decoding
    SWAPPED = 2  # KV moved (wholly or partly) to the host pool (the preemption issue)
    PREEMPTED = 3  # paused; its KV was dropped and will be recomputed
    FINISHED_STOPPED = 4  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 5  # reached max_tokens or the context length
    FINISHED_ABORTED = 6  # cancelled by the client or by a drain

    @property
    def is_finished(self) -> bool:
        return self >= RequestState.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """Why a request ended; the values are OpenAI's finish_reason strings."""

    STOP = "stop"  # EOS, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; validated by `validate()`."""

    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # per-request RNG seed; same seed + params -> same tokens
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids besides EOS
    ignore_eos: bool = False  # benchmarks force full lengths with this
    detokenize: bool = True  # produce text; benchmarks turn it off

    def validate(self) -> None:
        """Raise UserError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UserError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 <= float(self.temperature) <= 100.0):
            raise UserError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise UserError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < float(self.top_p) <= 1.0):
            raise UserError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise UserError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserError("stop must be a list of non-empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Rebuild:
    """A recompute that dropped only the oldest blocks: what to rebuild and where to continue."""

    until: int  # tokens [0, until) are computed again (the dropped blocks)
    resume_at: int  # num_computed_tokens once they are (the kept tail's end)


@dataclass(eq=False)
class Request:
    """One sequence in the engine. The scheduler owns its state changes.

    Compared by identity (eq=False): the queues test membership (`r in self.running`) every step, and
    the generated field-by-field __eq__ made that ~1.9 ms of a 64-sequence decode step."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # higher runs first (the preemption issue orders by it)
    tenant: str = "default"
    output_token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_preemptions: int = 0  # times this request was preempted
    admitted_time: float = 0.0  # monotonic time it last entered the running batch
    # Recompute that kept a tail of blocks: tokens [0, rebuild.until) are rebuilt first, then
    # num_computed_tokens jumps to rebuild.resume_at (the kept blocks cover the rest). Its blocks
    # themselves are the KV cache manager's (kv_cache/manager.py).
    rebuild: Rebuild | None = None
    num_recomputed_tokens: int = 0  # prefill work redone because of preemptions
    first_token_time: float | None = None  # monotonic time of the first output token
    finish_time: float | None = None
    # Sampling and detokenizer state (see engine/sampler.py, engine/detokenizer.py).
    generator: object | None = None  # torch.Generator, made at the first sampled token
    text: str = ""  # output text so far (truncated at a stop string)
    emitted_len: int = 0  # characters of text already handed out
    detok_ids: list[int] = field(default_factory=list)  # decode window: prompt tail + outputs
    prefix_offset: int = 0
    read_offset: int = 0

    def token_slice(self, start: int, n: int) -> list[int]:
        """Known tokens [start, start + n) without building prompt + outputs (a decode step needs one)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : start - p + n]
        return (self.prompt_token_ids + self.output_token_ids)[start : start + n]

    @property
    def gap_end(self) -> int:
        """End of the run of tokens to compute next: the dropped prefix, or everything known."""
        return self.rebuild.until if self.rebuild is not None else self.num_tokens

    def advance(self, n: int) -> None:
        """n more tokens' KV is in the cache; a rebuilt prefix reconnects to the kept tail."""
        self.num_computed_tokens += n
        if self.rebuild is not None and self.num_computed_tokens >= self.rebuild.until:
            self.num_computed_tokens = self.rebuild.resume_at
            self.rebuild = None

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV it has (or, while a dropped prefix is rebuilt, will have again)."""
        return self.rebuild.resume_at if self.rebuild is not None else self.num_computed_tokens

    @property
    def remaining_estimate(self) -> int:
        """Tokens still to generate, from max_tokens (the only length a server knows up front)."""
        return max(1, self.params.max_tokens - len(self.output_token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]  # tokens produced this step (0 or 1 today)
    new_text: str  # text produced this step ("" when detokenize is off)
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float  # monotonic
    first_token_time: float | None  # monotonic, None until the first token
    finish_time: float | None  # monotonic, None until finished

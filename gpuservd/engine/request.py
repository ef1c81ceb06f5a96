"""Requests, their sampling parameters and their lifecycle.

Only dataclasses cross layers: the engine hands `RequestOutput`s up to the CLI,
the bench and the daemon; the scheduler reads and updates `Request`s.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from gpuservd.errors import FieldError


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


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
# What the sampler can take without a step going wrong for the whole batch: below MIN_TEMPERATURE,
# logits / T overflows fp32 (inf, then NaN probabilities); the API raises smaller positive
# temperatures to this floor. Seeds are 64-bit (signed or unsigned), as every client sends them.
MIN_TEMPERATURE = 1e-2
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value


@dataclass
class GuidedSpec:
    """A grammar the output must follow, as the client sent it (compiled by engine/grammar.py)."""

    kind: str  # json_schema | json_object | regex | choice | grammar
    value: str  # the schema as JSON text, the regex, the choices as a JSON array, or the grammar text
    field: str  # the request field it came from, named in errors (response_format, guided_json, ...)


def _check_range(name: str, value, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(f"{name} must be a number, got {value!r}", name)
    if (value <= lo if lo_open else value < lo) or value > hi:
        interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise FieldError(f"{name} must be in {interval}, got {value!r}", name)


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise FieldError(f"{name} must be an integer {bound}, got {value!r}", name)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop; validated by `validate()`.

    Penalties follow OpenAI (presence/frequency, over the generated tokens) and
    vLLM (repetition, over prompt and generated tokens); engine/sampler.py has
    the formulas and the order they are applied in.
    """

    max_tokens: int = 16  # new tokens at most
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off; drop tokens below min_p x the top token's probability
    seed: int | None = None  # per-request RNG seed; same seed + params -> same tokens, whatever the batch
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids besides EOS
    ignore_eos: bool = False  # benchmarks force full lengths with this
    detokenize: bool = True  # produce text; benchmarks turn it off
    presence_penalty: float = 0.0  # [-2, 2]: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # [-2, 2]: subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # (0, 2]: vLLM's; > 1 discourages tokens of the prompt and output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, [-100, 100]
    min_tokens: int = 0  # EOS and stop token ids are masked until this many tokens are out
    logprobs: int | None = None  # None = off; N = the sampled token's logprob and the N most likely
    # None = off; N = each prompt token's logprob under the model (raw logits, from the prefill) and the N
    # most likely at its position (vLLM's prompt_logprobs; completions' echo with logprobs)
    prompt_logprobs: int | None = None
    guided: GuidedSpec | None = None  # a grammar the output must match (JSON schema, regex, choice, grammar)

    def validate(self) -> None:
        """Raise FieldError naming the first bad field."""
        _check_int("max_tokens", self.max_tokens, 1)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        if not (self.temperature == 0.0 or MIN_TEMPERATURE <= self.temperature <= 100.0):  # NaN fails both
            raise FieldError(f"temperature must be 0 (greedy) or between {MIN_TEMPERATURE} and 100, got "
                             f"{self.temperature!r}", "temperature")
        _check_int("top_k", self.top_k, 0)
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not SEED_MIN <= self.seed <= SEED_MAX):
            raise FieldError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise FieldError("stop must be a list of non-empty strings", "stop")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        if not isinstance(self.logit_bias, dict):
            raise FieldError("logit_bias must map token ids to numbers", "logit_bias")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
                raise FieldError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}", "logit_bias")
            _check_range("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)

    def check_vocab(self, vocab_size: int) -> None:
        """Raise FieldError when a token id the request names is outside the model's vocabulary."""
        for tok in self.logit_bias:
            if tok >= vocab_size:
                raise FieldError(f"logit_bias names token id {tok}; this model's ids are in [0, {vocab_size})",
                                 "logit_bias")
        for tok in self.stop_token_ids:
            if not 0 <= tok < vocab_size:
                raise FieldError(f"stop_token_ids names token id {tok}; this model's ids are in [0, {vocab_size})",
                                 "stop_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Any of the three penalties is on (the sampler then counts the tokens seen)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits or asks for more than the token: argmax alone."""
        return (self.greedy and not self.penalized and not self.logit_bias and not self.min_tokens
                and self.logprobs is None and self.guided is None)

    @property
    def plain_sampling(self) -> bool:
        """Sampling with temperature, top_k, top_p, min_p and a seed only (the device sampler's rows)."""
        return (not self.greedy and not self.penalized and not self.logit_bias and not self.min_tokens
                and self.logprobs is None and self.guided is None)


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
    arrival_step: int = 0  # the scheduler's step count when it was queued: the age SRF's aging counts from
    # Recompute that kept a tail of blocks: tokens [0, rebuild.until) are rebuilt first, then
    # num_computed_tokens jumps to rebuild.resume_at (the kept blocks cover the rest). Its blocks
    # themselves are the KV cache manager's (kv_cache/manager.py).
    rebuild: Rebuild | None = None
    num_recomputed_tokens: int = 0  # prefill work redone because of preemptions
    scheduled_time: float | None = None  # monotonic time it first entered the running batch
    first_token_time: float | None = None  # monotonic time of the first output token
    finish_time: float | None = None
    # Sampling and detokenizer state (see engine/sampler.py, engine/detokenizer.py).
    sample_seed: int = 0  # the seed of its random draws: params.seed, or a random one at admission
    grammar: object | None = None  # its live grammar matcher (engine/grammar.py) while guided and unfinished
    # params.prompt_logprobs: one entry per prompt position computed so far (sampler.TokenLogprobs; None for
    # the first token, which nothing predicts); handed out with the request's first output.
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False
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

    @property
    def wants_prompt_logits(self) -> bool:
        """Its prompt logprobs are still incomplete: its prefill needs the logits of every token, and it
        may not skip positions through the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)


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
    logprobs: list | None = None  # one sampler.TokenLogprobs per new token when params.logprobs is set
    # params.prompt_logprobs: one per prompt token (None first), on the request's first output only
    prompt_logprobs: list | None = None
    scheduled_time: float | None = None  # monotonic, None until it first entered the running batch

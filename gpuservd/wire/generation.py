"""A generation request as the daemon runs it: a /v1/completions or /v1/chat/completions body that
api/protocol.py has validated. Pure data: the API layer makes it, serving admits it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions body."""

    kind: str  # "completion" | "chat"
    model: str  # model name as the client sent it
    prompt: str | None = None  # completion: text prompt
    prompt_token_ids: list[int] | None = None  # completion: pre-tokenized prompt
    messages: list[dict] | None = None  # chat: [{"role", "content": str, ...tool_calls / tool_call_id}]
    max_tokens: int | None = None  # None = the rest of the context (chat) ; completions default 16
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (-1 accepted as off, as vLLM)
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: extra stop ids besides EOS
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    priority: int | None = None  # None = the tenant's priority
    ignore_eos: bool = False
    return_token_ids: bool = False  # add "token_ids" to every choice / chunk
    detokenize: bool = True  # False: no text (benchmarks), token ids only
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias in [-100, 100]
    min_tokens: int = 0
    logprobs: int | None = None  # None = off; N = each token's logprob and its N most likely alternatives
    n: int = 1  # choices returned
    best_of: int | None = None  # completions: generate this many, return the n most likely
    echo: bool = False  # completions: the prompt text before the output
    guided: dict | None = None  # {"kind", "value", "field"}: a grammar the output follows (structured.py)
    tools: list[dict] | None = None  # chat: [{"name", "description", "parameters"}]
    tool_choice: Any = "none"  # "none" | "auto" | "required" | {"name": ...}
    parallel_tool_calls: bool = True  # OpenAI's: more than one call per reply (False: the first call only)
    chat_template_kwargs: dict = field(default_factory=dict)  # extra variables for the chat template
    keep_alive: float | None = None  # Ollama's: seconds its model stays loaded idle after it (-1 forever, 0 none)

    @property
    def num_choices(self) -> int:
        """Engine requests this body fans out to (n, or best_of when larger)."""
        return max(self.n, self.best_of or 0)

    def summary(self) -> str:
        """What applies to this request, in a few words (the console's Requests screen, `requests ls`)."""
        parts = ["greedy" if self.temperature == 0 else f"t={self.temperature:g}"]
        for name, value, off in (("top_p", self.top_p, 1.0), ("top_k", self.top_k, 0), ("min_p", self.min_p, 0.0),
                                 ("presence", self.presence_penalty, 0.0), ("frequency", self.frequency_penalty, 0.0),
                                 ("repetition", self.repetition_penalty, 1.0), ("min_tokens", self.min_tokens, 0),
                                 ("n", self.n, 1), ("best_of", self.best_of or 1, 1)):
            if value != off:
                parts.append(f"{name}={value:g}")
        if self.seed is not None:
            parts.append(f"seed={self.seed}")
        if self.logit_bias:
            parts.append(f"logit_bias({len(self.logit_bias)})")
        if self.logprobs is not None:
            parts.append(f"logprobs={self.logprobs}")
        if self.guided:
            parts.append(f"{self.guided['kind']} ({self.guided['field']})")
        if self.tools:
            choice = self.tool_choice["name"] if isinstance(self.tool_choice, dict) else self.tool_choice
            parts.append(f"tools({len(self.tools)}, {choice})")
        if self.echo:
            parts.append("echo")
        return " ".join(parts)

    def sampling_kwargs(self) -> dict:
        """The fields of the engine's SamplingParams this request sets (all but max_tokens and guided)."""
        return dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                    seed=self.seed, stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                    ignore_eos=self.ignore_eos, detokenize=self.detokenize,
                    presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias),
                    min_tokens=self.min_tokens, logprobs=self.logprobs,
                    prompt_logprobs=self.logprobs if self.echo else None)

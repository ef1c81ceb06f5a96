"""Structured output: a grammar per constrained request, compiled and matched by llguidance.

Why llguidance and not xgrammar (both maintained, both used by vLLM and
SGLang): llguidance's wheel is one abi3 Rust library with no Python
dependencies, so it installs beside the CPU build of torch 2.13 without
touching it, while xgrammar's requires torch, triton and apache-tvm-ffi (triton
alone is a CUDA compiler toolchain this CPU box would carry for nothing). It
takes every format the API exposes directly: JSON schema (with OpenAI's strict
subset), regular expressions, Lark and GBNF grammars; and it computes a token
mask lazily, in tens of microseconds per step for JSON, with no per-grammar
precompilation over the vocabulary.

The engine keeps one `LLMatcher` per constrained request, advanced with every
token the request accepts. Each step the matchers of the constrained rows fill
their rows of one int32 bitmask (in parallel, outside the GIL); the sampler
applies it to those rows only, so unconstrained rows of the same batch pay
nothing. A matcher is dropped when its request finishes, is aborted or
cancelled (`release`); `num_live` says how many are held.
"""

from __future__ import annotations

import json
import logging

import llguidance
import torch

from gpuservd.engine.request import GuidedSpec, Request
from gpuservd.errors import FieldError

log = logging.getLogger(__name__)


def to_grammar(spec: GuidedSpec) -> str:
    """llguidance's grammar text for a spec; a FieldError naming spec.field when it cannot be compiled."""
    try:
        if spec.kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                spec.value, overrides={"whitespace_flexible": False})
        elif spec.kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        elif spec.kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec.value)
        elif spec.kind == "choice":
            choices = json.loads(spec.value)
            grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        elif spec.kind == "grammar":
            grammar = llguidance.grammar_from("grammar", spec.value)
        else:
            raise FieldError(f"{spec.field}: unknown grammar kind {spec.kind!r}", spec.field)
    except (ValueError, TypeError) as exc:
        raise FieldError(f"{spec.field} could not be compiled: {_one_line(exc)}", spec.field) from None
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise FieldError(f"{spec.field} could not be compiled: {_one_line(error)}", spec.field)
    return grammar


def _one_line(err) -> str:
    text = " ".join(str(err).split())  # llguidance's messages span lines (a caret under the regex)
    return text[:300] if text else type(err).__name__


class Grammars:
    """The engine's grammar state: llguidance's view of the tokenizer and the live matchers."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the logits' width: the bitmask covers every column
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.live: dict[str, llguidance.LLMatcher] = {}  # request id -> its matcher

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        # Built at the first constrained request, not at engine start: it reads the whole vocabulary
        # (about a second for a 50k one) and most deployments never send a grammar.
        if self._tokenizer is None:
            import llguidance.hf  # imports transformers' tokenizer classes; only needed here

            self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_token_ids or None)
            self._executor = llguidance.LLExecutor()
        return self._tokenizer

    @property
    def num_live(self) -> int:
        return len(self.live)

    def start(self, req: Request) -> None:
        """Compile the request's grammar and attach a fresh matcher (FieldError when it does not compile)."""
        spec = req.params.guided
        matcher = llguidance.LLMatcher(self.tokenizer, to_grammar(spec), log_level=0)
        if matcher.is_error():
            raise FieldError(f"{spec.field} could not be compiled: {_one_line(matcher.get_error())}", spec.field)
        req.grammar = matcher
        self.live[req.request_id] = matcher

    def fill(self, requests: list[Request]) -> tuple[torch.Tensor | None, list[bool]]:
        """The bitmask int32 [S, ceil(V/32)] of one step and which rows it constrains (None: no row)."""
        masked = [r.grammar is not None for r in requests]
        if not any(masked):
            return None, masked
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(requests), words), -1, dtype=torch.int32)
        jobs = [(r.grammar, i) for i, r in enumerate(requests) if r.grammar is not None]
        self._executor.unsafe_compute_mask_ptr(jobs, bitmask.data_ptr(), words * 4, len(requests))
        return bitmask, masked

    def advance(self, req: Request, token_id: int) -> bool:
        """Feed the sampled token to the request's matcher; True when the grammar is complete (or broken),
        so the output ends here."""
        m = req.grammar
        if m is None:
            return False
        if not m.consume_token(token_id):
            log.warning("request %s: grammar matcher refused token %d: %s", req.request_id, token_id,
                        m.get_error())
            return True
        return m.is_stopped()

    def release(self, req: Request) -> None:
        """Drop the request's matcher (finish, abort, cancel)."""
        req.grammar = None
        self.live.pop(req.request_id, None)

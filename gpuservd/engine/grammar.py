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
their rows of one int32 bitmask (in parallel, outside the GIL, beside the
forward on a GPU); the sampler applies it to those rows only, so unconstrained
rows of the same batch pay nothing. A matcher is dropped when its request finishes, is aborted or
cancelled (`release`); `num_live` says how many are held.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import llguidance
import torch

from gpuservd.background import in_background
from gpuservd.engine.request import GuidedSpec, Request
from gpuservd.errors import FieldError

log = logging.getLogger(__name__)
# How long an otherwise idle step waits for llguidance's tokenizer when only constrained requests wait on it
# (instead of spinning through empty steps).
IDLE_WAIT_S = 0.05


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
    """The engine's grammar state: llguidance's view of the tokenizer and the live matchers.

    llguidance's tokenizer reads the whole vocabulary (about a second for a 50k one), so it is built on a
    thread of its own at the first constrained request, not at engine start (most deployments never send a
    grammar) and not on the engine thread (that would stall every running request for that second). Until
    it is ready, constrained requests wait in `pending` (their grammar already checked, so a bad one is
    still refused at once) while the rest of the batch runs on.

    Masks: with `overlap` (a CUDA device), the step's masks are computed on a worker thread while the
    forward runs (llguidance releases the GIL); on the CPU the forward's own thread team has the cores,
    and the masks (well under a millisecond for a batch) are filled after it instead of competing with it.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids, overlap: bool = False):
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the logits' width: the bitmask covers every column
        self.eos_token_ids = sorted(eos_token_ids)
        self.overlap = overlap
        self._built: Future | None = None  # -> (LLTokenizer, LLExecutor)
        self._mask_worker: ThreadPoolExecutor | None = None
        self.live: dict[str, llguidance.LLMatcher] = {}  # request id -> its matcher
        self.pending: dict[str, tuple[Request, str]] = {}  # waiting for the tokenizer: id -> (request, grammar)

    def _build(self) -> tuple[llguidance.LLTokenizer, llguidance.LLExecutor]:
        import llguidance.hf  # imports transformers' tokenizer classes; only needed here

        tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                 eos_token=self.eos_token_ids or None)
        return tokenizer, llguidance.LLExecutor()

    def warm(self) -> Future:
        """Start building llguidance's tokenizer (once); the future is done when it is ready."""
        if self._built is None:
            self._built = in_background("grammar-tokenizer", self._build)
        return self._built

    @property
    def ready(self) -> bool:
        return self._built is not None and self._built.done()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, waiting for it to be built (tests, tools; the engine uses start())."""
        return self.warm().result()[0]

    @property
    def num_live(self) -> int:
        return len(self.live)

    def start(self, req: Request) -> bool:
        """Check the request's grammar (FieldError when it does not compile) and attach a matcher: True, or
        False when the tokenizer is still being built (the request is then in `pending` until take_ready)."""
        grammar = to_grammar(req.params.guided)
        if not self.ready:
            self.warm()
            self.pending[req.request_id] = (req, grammar)
            return False
        self._attach(req, grammar)
        return True

    def _attach(self, req: Request, grammar: str) -> None:
        spec = req.params.guided
        matcher = llguidance.LLMatcher(self._built.result()[0], grammar, log_level=0)
        if matcher.is_error():
            raise FieldError(f"{spec.field} could not be compiled: {_one_line(matcher.get_error())}", spec.field)
        req.grammar = matcher
        self.live[req.request_id] = matcher

    def take_ready(self, wait_s: float = 0.0) -> tuple[list[Request], list[tuple[Request, Exception]]]:
        """The pending requests whose matchers are attached now that the tokenizer is ready, and those
        that failed (their grammar, or the tokenizer build itself); waits up to wait_s for the build."""
        if not self.pending:
            return [], []
        try:
            self._built.result(timeout=wait_s)
        except FutureTimeout:
            return [], []
        except Exception:  # the build failed: every waiting request fails with its error
            pass
        ready, failed = [], []
        for rid, (req, grammar) in list(self.pending.items()):
            del self.pending[rid]
            try:
                self._attach(req, grammar)
                ready.append(req)
            except Exception as exc:
                failed.append((req, exc))
        return ready, failed

    def admit(self, scheduler, idle: bool) -> list[tuple[Request, Exception]]:
        """Hand the scheduler the pending requests whose matchers are ready (waiting up to IDLE_WAIT_S for
        the tokenizer when the engine is idle); returns those that failed, for the engine to fail."""
        ready, failed = self.take_ready(wait_s=IDLE_WAIT_S if idle else 0.0)
        for req in ready:
            scheduler.add(req)
        return failed

    def fill(self, requests: list[Request]) -> tuple[torch.Tensor | None, list[bool]]:
        """The bitmask int32 [S, ceil(V/32)] of one step and which rows it constrains (None: no row)."""
        masked = [r.grammar is not None for r in requests]
        if not any(masked):
            return None, masked
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(requests), words), -1, dtype=torch.int32)
        jobs = [(r.grammar, i) for i, r in enumerate(requests) if r.grammar is not None]
        self._built.result()[1].unsafe_compute_mask_ptr(jobs, bitmask.data_ptr(), words * 4, len(requests))
        return bitmask, masked

    def fill_async(self, requests: list[Request]) -> Future | None:
        """fill(requests) on the mask worker while the caller runs the forward (None: nothing to fill, or
        no overlap on this device). The matchers must not advance before the future is done."""
        if not self.overlap or not any(r.grammar is not None for r in requests):
            return None
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        return self._mask_worker.submit(self.fill, list(requests))

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
        """Drop the request's matcher, or its place in the queue for the tokenizer (finish, abort, cancel)."""
        req.grammar = None
        self.live.pop(req.request_id, None)
        self.pending.pop(req.request_id, None)

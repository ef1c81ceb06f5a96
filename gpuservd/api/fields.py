"""Which request fields the OpenAI routes accept, and at which values (pure data, no I/O).

Three kinds besides the fields gpuserv implements (protocol.py parses those):

- `OFF_VALUES`: OpenAI fields gpuserv does not implement, accepted only at the
  value that means "off"; any other value is a 400 naming the field.
- `NEUTRAL`: extension fields that vLLM's and SGLang's clients and routers send
  (vLLM's router serializes several of them on every request, at their
  defaults). At the neutral value they change nothing here, so they are
  accepted and ignored with a debug log; a non-neutral value asks for behaviour
  gpuserv does not have and is a 400 naming the field.
- `IGNORED`: bookkeeping fields that never change the output (any value).

Anything else is refused as OpenAI refuses it ("Unrecognized request argument
supplied: ..."), so a typo never silently runs the defaults. README.md's
"Request fields" table lists every field and what it does.
"""

from __future__ import annotations

import json
from typing import Any, Callable


def _is(*values) -> Callable[[Any], bool]:
    return lambda v: any(v is x or (type(v) is type(x) and v == x) for x in values)


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == []


_BOOL = lambda v: v is None or isinstance(v, bool)  # noqa: E731 - either value behaves the same here

# OpenAI fields gpuserv does not implement: name -> "is this the off value?"
OFF_VALUES: dict[str, Callable[[Any], bool]] = {
    "suffix": lambda v: v in (None, ""),
    "functions": _empty,
    "function_call": lambda v: v in (None, "none", "auto"),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}

# vLLM / SGLang / router extension fields at their neutral values: name -> "is this neutral?"
NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "no_stop_trim": _is(None, False),
    "skip_special_tokens": _is(None, True),
    "spaces_between_special_tokens": _is(None, True),
    "continue_final_message": _is(None, False),
    "add_generation_prompt": _is(None, True),
    "include_stop_str_in_output": _is(None, False),
    "return_tokens_as_token_ids": _is(None, False),
    "return_hidden_states": _is(None, False),
    "use_beam_search": _is(None, False),
    "length_penalty": _is(None, 1, 1.0),
    "prompt_logprobs": _is(None, 0),
    "truncate_prompt_tokens": _is(None),
    "allowed_token_ids": _is(None),
    "bad_words": _empty,
    "logits_processors": _empty,
    "lora_path": _is(None),
    "lora_request": _is(None),
    "kv_transfer_params": _is(None),
    "mm_processor_kwargs": _empty,
    "documents": _empty,
    "cache_salt": _is(None),
    "vllm_xargs": _empty,
    "guided_whitespace_pattern": _is(None),
    "guided_decoding_backend": lambda v: v is None or isinstance(v, str),  # picks a backend; there is one
    "structural_tag": _is(None),
    # Reasoning sections: gpuserv's models have none, so either value gives the same output.
    "separate_reasoning": _BOOL,
    "stream_reasoning": _BOOL,
    "include_reasoning": _BOOL,
    # Chat only (completions never render a template).
    "add_special_tokens": _is(None, False),
}

# Bookkeeping that does not change the output: accepted with any value.
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort",
           "prompt_cache_key", "safety_identifier", "verbosity", "session_params", "request_id",
           "bootstrap_host", "bootstrap_port", "bootstrap_room"}


def refused(key: str, value: Any) -> str | None:
    """Why a field outside the implemented ones is refused at this value, or None when it is accepted."""
    if key in OFF_VALUES:
        return None if OFF_VALUES[key](value) else f"{key} is not supported by this server (accepted only at its default)"
    if key in NEUTRAL:
        return None if NEUTRAL[key](value) else (f"{key}={json.dumps(value)[:40]} is not supported by this server (accepted only at "
                                                 "its neutral value)")
    if key in IGNORED:
        return None
    return f"Unrecognized request argument supplied: {key}"

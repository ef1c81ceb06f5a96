"""The wire protocol: OpenAI-compatible request parsing (errors in errors.py, field policy in fields.py).

Pure data and validation; no torch, no engine, no I/O, so the client, the CLI
and the console can import it and start fast. A bad field is a 400 whose
message names the field and what is expected. Extensions (vLLM's where one
exists): `top_k`, `min_p`, `min_tokens`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`, `priority`, `return_token_ids`, `detokenize`,
the guided-decoding fields (structured.py) and `chat_template_kwargs`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

from gpuservd.api import fields, json_body, structured
from gpuservd.api.apierror import (APIError, bad_request, internal_error, model_not_found,  # noqa: F401
                                 rate_limited, unavailable)
from gpuservd.wire.generation import GenerationRequest  # what the parsers return (routes import it from here too)

log = logging.getLogger(__name__)

TENANT_HEADER = "x-gpuserv-tenant"  # lets a trusted client name its tenant (see profiles/tenants.yaml)
REQUEST_ID_HEADER = "x-request-id"  # the client's id for the request (kept), or the daemon's; on every response


# ---- request parsing ------------------------------------------------------------------------------


MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit on /v1/completions `logprobs`
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on chat `top_logprobs`
MAX_N = 16  # the default of server.max_n (choices per request); the daemon passes its own
# The sampler's limits, checked here so that no value a client sends can make an engine step go wrong for
# the whole batch. Seeds are 64-bit, signed or unsigned. logits / temperature must stay finite in fp32:
# below MIN_TEMPERATURE a logit of ~40 already overflows and the softmax is NaN, so a smaller positive
# temperature is raised to it (vLLM does the same; the distribution is then one-hot on the argmax).
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 64 - 1
MIN_TEMPERATURE = 1e-2
MAX_TOP_K = 2 ** 31 - 1  # a top_k at least the vocabulary size is "off"; beyond int32 it is nonsense
PRIORITY_MIN, PRIORITY_MAX = -(2 ** 31), 2 ** 31 - 1
# Model names are looked up in the store and routed; they never need more than this. Checked before
# anything (metrics, predictors, logs) sees the name.
MAX_MODEL_NAME_LEN = 128
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
           "stream", "stream_options", "n", "priority", "ignore_eos", "return_token_ids", "detokenize",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
           "logprobs", "keep_alive"} | structured.GUIDED_FIELDS
_COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                          "parallel_tool_calls", "chat_template_kwargs"}
# Chat fields with another meaning in vLLM's chat API: accepted at the neutral value only.
_CHAT_NEUTRAL = {"echo": lambda v: v in (None, False), "best_of": lambda v: v in (None, 1)}


def _type_name(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _int(body: dict, key: str, lo: int | None = None, default=None, hi: int | None = None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{key} must be an integer, got {_type_name(v)} {json.dumps(v)[:40]}", key, "invalid_type")
    if lo is not None and v < lo:
        raise bad_request(f"{key} must be >= {lo}, got {v}", key)
    if hi is not None and v > hi:
        raise bad_request(f"{key} must be <= {hi}, got {str(v)[:40]}", key)
    return v


_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _keep_alive(body: dict) -> float | None:
    """Ollama's keep_alive: seconds as a number, or a duration like "5m", "30s", "1h", "-1" (negative: forever)."""
    v = body.get("keep_alive")
    if v is None:
        return None
    m = _DURATION.match(v) if isinstance(v, str) else None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if m is None:
        raise bad_request(f"keep_alive must be seconds or a duration like \"5m\", \"30s\", \"-1\"; got {v!r}",
                          "keep_alive")
    return float(m.group(1)) * _DURATION_S[m.group(2)]


def _num(body: dict, key: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"{key} must be a number, got {_type_name(v)} {json.dumps(v)[:40]}", key, "invalid_type")
    if not math.isfinite(v):
        raise bad_request(f"{key} must be a finite number, got {v}", key)
    if (v <= lo if lo_open else v < lo) or v > hi:
        interval = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise bad_request(f"{key} must be in {interval}, got {v}", key)
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{key} must be a boolean, got {_type_name(v)}", key, "invalid_type")
    return v


def _check_fields(body: dict, allowed: set[str], kind: str) -> None:
    for key, value in body.items():
        if key in allowed:
            continue
        if kind == "chat" and key in _CHAT_NEUTRAL:
            why = None if _CHAT_NEUTRAL[key](value) else f"{key} is not supported on /v1/chat/completions"
        else:
            why = fields.refused(key, value)
        if why is not None:
            code = "unknown_parameter" if why.startswith("Unrecognized") else "unsupported_value"
            raise bad_request(why, key, code)
        log.debug("ignored request field %s=%s (neutral or bookkeeping)", key, json.dumps(value)[:80])


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) or not s for s in stop):
        raise bad_request("stop must be a non-empty string or an array of non-empty strings", "stop", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}", "stop")
    return stop


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("stream_options must be an object", "stream_options", "invalid_type")
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise bad_request(f"stream_options.{sorted(unknown)[0]} is not supported", "stream_options")
    if not isinstance(options.get("include_usage", False), bool):
        raise bad_request("stream_options.include_usage must be a boolean", "stream_options.include_usage",
                          "invalid_type")
    return bool(options.get("include_usage"))


def _token_ids(body: dict, key: str) -> list[int]:
    v = body.get(key)
    if v is None:
        return []
    if not isinstance(v, list) or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in v):
        raise bad_request(f"{key} must be an array of token ids (integers >= 0)", key, "invalid_type")
    return list(v)


def _logit_bias(body: dict) -> dict[int, float]:
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad_request("logit_bias must map token ids to numbers in [-100, 100]", "logit_bias", "invalid_type")
    out = {}
    for key, value in raw.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            tok = -1
        if tok < 0 or str(tok) != str(key).strip():
            raise bad_request(f"logit_bias keys must be token ids (integers >= 0), got {json.dumps(key)[:40]}",
                              "logit_bias", "invalid_type")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request(f"logit_bias[{key}] must be a number in [-100, 100], got {json.dumps(value)[:40]}",
                              "logit_bias")
        out[tok] = float(value)
    return out


def _common(body: Any, allowed: set[str], kind: str, max_n: int) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_type_name(body)}", None, "invalid_type")
    _check_fields(body, allowed, kind)
    model = check_model_name(body.get("model"), "model" in body)
    stream = _bool(body, "stream")
    top_k = _int(body, "top_k", -1, 0, MAX_TOP_K)
    temperature = _num(body, "temperature", 0.0, 2.0, 1.0)
    req = GenerationRequest(
        kind=kind,
        model=model,
        temperature=max(temperature, MIN_TEMPERATURE) if temperature > 0 else 0.0,
        top_p=_num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        min_p=_num(body, "min_p", 0.0, 1.0, 0.0),
        seed=_int(body, "seed", SEED_MIN, None, SEED_MAX),
        stop=_stop(body),
        stop_token_ids=_token_ids(body, "stop_token_ids"),
        stream=stream,
        include_usage=_stream_options(body, stream),
        priority=_int(body, "priority", PRIORITY_MIN, None, PRIORITY_MAX),
        ignore_eos=_bool(body, "ignore_eos"),
        return_token_ids=_bool(body, "return_token_ids"),
        detokenize=_bool(body, "detokenize", True),
        presence_penalty=_num(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=_num(body, "frequency_penalty", -2.0, 2.0, 0.0),
        repetition_penalty=_num(body, "repetition_penalty", 0.0, 2.0, 1.0, lo_open=True),
        logit_bias=_logit_bias(body),
        min_tokens=_int(body, "min_tokens", 0, 0),
        n=_int(body, "n", 1, 1),
        guided=structured.parse_guided(body),
        keep_alive=_keep_alive(body),
    )
    if req.n > max_n:
        raise bad_request(f"n must be <= {max_n} (this server's server.max_n), got {req.n}", "n")
    if not req.detokenize and req.stop:
        raise bad_request("stop strings need text: drop stop or set detokenize to true", "stop")
    if not req.detokenize and req.guided:
        raise bad_request(f"{req.guided['field']} needs text: set detokenize to true", req.guided["field"])
    return req


def parse_completion(body: Any, max_n: int = MAX_N) -> GenerationRequest:
    """Validate a /v1/completions body."""
    req = _common(body, _COMPLETION_FIELDS, "completion", max_n)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.prompt_token_ids = list(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request(f"prompt holds {len(prompt)} prompts; this server takes one prompt per request", "prompt",
                          "unsupported_value")
    else:
        raise bad_request("prompt is required: a string or an array of token ids", "prompt",
                          "missing_required_parameter" if prompt is None else "invalid_type")
    req.max_tokens = _int(body, "max_tokens", 1, 16)
    lp = body.get("logprobs")
    req.logprobs = None if lp is None or lp is False else _int(body, "logprobs", 0, None, hi=MAX_COMPLETION_LOGPROBS)
    req.echo = _bool(body, "echo")  # with logprobs: the prompt's tokens get theirs too (the engine's prompt_logprobs)
    req.best_of = _int(body, "best_of", 1, None)
    if req.best_of is not None:
        if req.best_of > max_n:
            raise bad_request(f"best_of must be <= {max_n} (this server's server.max_n), got {req.best_of}", "best_of")
        if req.best_of < req.n:
            raise bad_request(f"best_of ({req.best_of}) must be >= n ({req.n})", "best_of")
        if req.stream and req.best_of > 1:
            raise bad_request("best_of cannot be used with stream (the best choices are known only at the end)",
                              "best_of")
    _check_min_tokens(req)
    return req


def _check_min_tokens(req: GenerationRequest) -> None:
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must be <= max_tokens ({req.max_tokens})", "min_tokens")


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content[{j}] must be a text part {{\"type\": \"text\", \"text\": ...}}"
                                  " (this server takes text only)", f"messages[{i}].content", "unsupported_value")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or an array of text parts, got {_type_name(content)}",
                      f"messages[{i}].content", "invalid_type")


def _tool_calls(calls: Any, i: int) -> list[dict]:
    """An assistant message's tool_calls, checked: [{"id", "type", "function": {"name", "arguments"}}]."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be an array", where, "invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                not isinstance(fn.get("arguments", "{}"), str):
            raise bad_request(f"{where}[{j}] must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              "\"arguments\": JSON text}}}}", f"{where}[{j}]", "invalid_type")
        out.append({"id": str(c.get("id", f"call_{j}")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn.get("arguments", "{}")}})
    return out


def _message(m: Any, i: int) -> dict:
    if not isinstance(m, dict):
        raise bad_request(f"messages[{i}] must be an object with role and content", f"messages[{i}]", "invalid_type")
    role = m.get("role")
    if role == "developer":
        role = "system"  # OpenAI's newer name for the system role
    if role not in ("system", "user", "assistant", "tool"):
        raise bad_request(f"messages[{i}].role must be one of system, developer, user, assistant, tool; "
                          f"got {json.dumps(role)[:40]}", f"messages[{i}].role")
    calls = m.get("tool_calls") if role == "assistant" else None
    content = m.get("content")
    out = {"role": role, "content": "" if content is None and calls else _content_text(content, i)}
    if calls:
        out["tool_calls"] = _tool_calls(calls, i)
    if role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise bad_request(f"messages[{i}].tool_call_id is required for a tool message", f"messages[{i}].tool_call_id",
                              "missing_required_parameter")
        out["tool_call_id"] = tid
    return out


def parse_chat(body: Any, max_n: int = MAX_N) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    req = _common(body, _CHAT_FIELDS, "chat", max_n)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages is required: a non-empty array of {role, content} objects", "messages",
                          "missing_required_parameter" if messages is None else "invalid_type")
    req.messages = [_message(m, i) for i, m in enumerate(messages)]
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    req.max_tokens = _int(body, limit, 1, None)
    if _bool(body, "logprobs"):
        req.logprobs = _int(body, "top_logprobs", 0, 0, hi=MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") not in (None, 0):
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs", "invalid_type")
    req.chat_template_kwargs = dict(kwargs or {})
    req.tools, req.tool_choice = structured.parse_tools(body)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls", "invalid_type")
    req.parallel_tool_calls = parallel is not False
    if req.tool_choice == "required" or isinstance(req.tool_choice, dict):
        if req.guided is not None:
            raise bad_request(f"tool_choice {json.dumps(req.tool_choice)} already constrains the output; drop "
                              f"{req.guided['field']}", "tool_choice")
        from_tools = structured.tool_call_schema(req.tools, req.tool_choice, req.parallel_tool_calls)
        req.guided = {"kind": "json_schema", "value": json.dumps(from_tools), "field": "tool_choice"}
    _check_min_tokens(req)
    return req


def check_model_name(model: Any, present: bool = True) -> str:
    """A model name as sent by a client, or a 400: bounded in length and characters before anything
    records it (a name is a dict key in several places, and a 1 MB name would be kept there)."""
    if not isinstance(model, str) or not model:
        raise bad_request("model is required and must be a non-empty string (GET /v1/models lists them)", "model",
                          "invalid_type" if present else "missing_required_parameter")
    if len(model) > MAX_MODEL_NAME_LEN or not MODEL_NAME_RE.fullmatch(model):
        shown = json.dumps(model[:40]) + ("..." if len(model) > 40 else "")
        raise bad_request(f"model {shown} is not a model name: at most {MAX_MODEL_NAME_LEN} characters of "
                          "letters, digits and . _ - : / @ +, starting with a letter or digit", "model")
    return model


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 that says where it broke (see json_body for the limits)."""
    if not raw:
        raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
    try:
        return json_body.loads(raw)
    except json_body.BodyError as exc:
        raise bad_request(str(exc), exc.param, "invalid_json") from None

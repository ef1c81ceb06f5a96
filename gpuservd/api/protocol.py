"""The wire protocol: OpenAI-compatible request parsing, response shapes and errors.

Pure data and validation; no torch, no engine, no I/O, so the client, the CLI
and the console can import it and start fast. Every error a client can cause
is an `APIError` whose body has OpenAI's shape
(`{"error": {"message", "type", "param", "code"}}`) and whose message names the
field and what is expected.

Field policy: the fields OpenAI defines are accepted; the ones we do not
implement are accepted only at their "off" value (for example
`presence_penalty: 0`, `logprobs: null`), anything else is a 400 naming the
field. Unknown fields are refused the way OpenAI refuses them
("Unrecognized request argument supplied: ..."), so a typo never silently runs
the defaults. Extensions (vLLM's where one exists): `top_k`, `ignore_eos`,
`priority`, `return_token_ids`, `detokenize`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TENANT_HEADER = "x-gpuserv-tenant"  # lets a trusted client name its tenant (see profiles/tenants.yaml)
REQUEST_ID_HEADER = "x-request-id"  # every response carries the daemon's id for the request


class APIError(Exception):
    """An HTTP error with an OpenAI-shaped body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status  # HTTP status code
        self.message = message  # one line, says what to fix
        self.type = type  # OpenAI error type
        self.param = param  # the offending field, if one
        self.code = code  # machine-readable code
        self.headers = headers or {}  # extra response headers (Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def model_not_found(name: str, available: list[str], hint: str = "") -> APIError:
    names = ", ".join(available) if available else "none"
    return APIError(404, f"The model `{name}` does not exist or is not loaded; loaded models: {names}.{hint}",
                    "invalid_request_error", "model", "model_not_found")


def rate_limited(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, "rate_limit_error", None, "rate_limit_exceeded",
                    {"Retry-After": str(max(1, int(retry_after_s)))})


def unavailable(message: str, code: str = "unavailable", retry_after_s: int | None = None) -> APIError:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s else {}
    return APIError(503, message, "service_unavailable", None, code, headers)


def internal_error(request_id: str) -> APIError:
    return APIError(500, f"internal error while serving request {request_id}; the daemon log has the details "
                         f"under that id", "server_error", None, "internal_error")


# ---- request parsing ------------------------------------------------------------------------------

@dataclass
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions body."""

    kind: str  # "completion" | "chat"
    model: str  # model name as the client sent it
    prompt: str | None = None  # completion: text prompt
    prompt_token_ids: list[int] | None = None  # completion: pre-tokenized prompt
    messages: list[dict] | None = None  # chat: [{"role", "content": str}]
    max_tokens: int | None = None  # None = the rest of the context (chat) ; completions default 16
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (-1 accepted as off, as vLLM)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    priority: int | None = None  # None = the tenant's priority
    ignore_eos: bool = False
    return_token_ids: bool = False  # add "token_ids" to every choice / chunk
    detokenize: bool = True  # False: no text (benchmarks), token ids only


# OpenAI fields we accept only at their "off" value: name -> predicate on the value.
_OFF_VALUES = {
    "frequency_penalty": lambda v: v in (None, 0, 0.0),
    "presence_penalty": lambda v: v in (None, 0, 0.0),
    "repetition_penalty": lambda v: v in (None, 1, 1.0),
    "logit_bias": lambda v: v in (None, {}),
    "logprobs": lambda v: v in (None, False, 0),
    "top_logprobs": lambda v: v in (None, 0),
    "echo": lambda v: v in (None, False),
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none", "auto"),
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none", "auto"),
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "modalities": lambda v: v in (None, ["text"]),
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}
# Accepted and ignored: bookkeeping fields that do not change the output.
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "reasoning_effort",
            "prompt_cache_key", "safety_identifier", "verbosity"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "n", "priority", "ignore_eos", "return_token_ids", "detokenize"}
_COMPLETION_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
MAX_STOP_STRINGS = 16


def _type_name(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _int(body: dict, key: str, lo: int | None = None, default=None) -> int | None:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"{key} must be an integer, got {_type_name(v)} {json.dumps(v)[:40]}", key, "invalid_type")
    if lo is not None and v < lo:
        raise bad_request(f"{key} must be >= {lo}, got {v}", key)
    return v


def _num(body: dict, key: str, lo: float, hi: float, default: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"{key} must be a number, got {_type_name(v)} {json.dumps(v)[:40]}", key, "invalid_type")
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


def _common(body: Any, allowed: set[str], kind: str) -> GenerationRequest:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_type_name(body)}", None, "invalid_type")
    for key in body:
        if key in _OFF_VALUES:
            if not _OFF_VALUES[key](body[key]):
                raise bad_request(f"{key} is not supported by this server (accepted only at its default)", key,
                                  "unsupported_value")
        elif key not in allowed and key not in _IGNORED:
            raise bad_request(f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required and must be a non-empty string (GET /v1/models lists them)", "model",
                          "invalid_type" if "model" in body else "missing_required_parameter")
    n = _int(body, "n", 1, 1)
    if n != 1:
        raise bad_request(f"n must be 1 (this server returns one choice per request; send {n} requests)", "n",
                          "unsupported_value")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or any(not isinstance(s, str) or not s for s in stop):
        raise bad_request("stop must be a non-empty string or an array of non-empty strings", "stop", "invalid_type")
    if len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS}", "stop")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
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
    top_k = _int(body, "top_k", -1, 0)
    req = GenerationRequest(
        kind=kind,
        model=model,
        temperature=_num(body, "temperature", 0.0, 2.0, 1.0),
        top_p=_num(body, "top_p", 0.0, 1.0, 1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        seed=_int(body, "seed"),
        stop=stop,
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        priority=_int(body, "priority"),
        ignore_eos=_bool(body, "ignore_eos"),
        return_token_ids=_bool(body, "return_token_ids"),
        detokenize=_bool(body, "detokenize", True),
    )
    if not req.detokenize and req.stop:
        raise bad_request("stop strings need text: drop stop or set detokenize to true", "stop")
    return req


def parse_completion(body: Any) -> GenerationRequest:
    """Validate a /v1/completions body."""
    req = _common(body, _COMPLETION_FIELDS, "completion")
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
    return req


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


def parse_chat(body: Any) -> GenerationRequest:
    """Validate a /v1/chat/completions body."""
    req = _common(body, _CHAT_FIELDS, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages is required: a non-empty array of {role, content} objects", "messages",
                          "missing_required_parameter" if messages is None else "invalid_type")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object with role and content", f"messages[{i}]",
                              "invalid_type")
        role = m.get("role")
        if role == "developer":
            role = "system"  # OpenAI's newer name for the system role
        if role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role must be one of system, developer, user, assistant, tool; "
                              f"got {json.dumps(role)[:40]}", f"messages[{i}].role")
        clean.append({"role": role, "content": _content_text(m.get("content"), i)})
    req.messages = clean
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    req.max_tokens = _int(body, limit, 1, None)
    return req


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 400 that says where it broke."""
    if not raw:
        raise bad_request("the request body is empty; send a JSON object", None, "invalid_json")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise bad_request(f"the request body is not valid JSON{where}: {getattr(exc, 'msg', str(exc))}", None,
                          "invalid_json") from None

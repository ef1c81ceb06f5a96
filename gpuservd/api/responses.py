"""OpenAI-shaped response bodies and server-sent events (no torch, no I/O).

A stream is `data: <chunk json>` events ending with `data: [DONE]`; with
`stream_options.include_usage` every chunk carries `"usage": null` and one
last chunk with no choices carries the usage, as OpenAI sends them.

JSON is written by orjson (several times faster than the standard library on
every chunk of every stream): compact, UTF-8 rather than backslash-u escapes, which any
JSON reader takes the same. A string orjson refuses (a lone surrogate, which a
client can send as an escaped prompt and `echo` returns) falls back to the
standard library's escaping.

Three characters are escaped all the same: U+0085, U+2028 and U+2029. JSON allows them raw, but
they end a line for Python's str.splitlines, and so for clients that read a stream by its lines
that way (httpx's `iter_lines`): a token that decodes to one would cut its `data:` line in two and
the client's JSON parse would fail mid-stream. As escapes they are the same JSON to every reader.
"""

from __future__ import annotations

import json
import math

import orjson

LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token outside the sampled distribution reports this (as vLLM)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def stream_chunk(kind: str, request_id: str, model: str, created: int, text: str | None,
                 finish_reason: str | None = None, token_ids: list[int] | None = None, role: bool = False,
                 include_usage: bool = False, index: int = 0, logprobs: dict | None = None,
                 tool_calls: list[dict] | None = None) -> dict:
    """One SSE chunk; `text=None` with role=True is chat's opening chunk."""
    if kind == "chat":
        delta: dict = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk = {"id": request_id, "object": obj, "created": created, "model": model, "choices": [choice]}
    if include_usage:
        chunk["usage"] = None  # OpenAI sends usage: null on every chunk but the last
    return chunk


class ChunkEncoder:
    """SSE chunks of one stream, fast: the JSON around the new text is rendered once per stream.

    Byte-for-byte what `sse(stream_chunk(...))` gives (a test checks); only a
    chunk that carries a finish_reason takes the slow path.
    """

    _TEXT, _IDS = "@@gpuserv-text@@", "@@gpuserv-ids@@"

    def __init__(self, kind: str, request_id: str, model: str, created: int, token_ids: bool, include_usage: bool,
                 index: int = 0):
        self.args = (kind, request_id, model, created)
        self.token_ids = token_ids
        self.include_usage = include_usage
        self.index = index
        chunk = stream_chunk(kind, request_id, model, created, self._TEXT, None,
                             [self._IDS] if token_ids else None, include_usage=include_usage, index=index)
        raw = sse(chunk)
        self._head, rest = raw.split(dumps(self._TEXT), 1)
        self._mid, self._tail = rest.split(dumps([self._IDS]), 1) if token_ids else (rest, b"")

    def encode(self, text: str, finish_reason: str | None = None, token_ids: list[int] | None = None) -> bytes:
        if finish_reason is not None:
            return sse(stream_chunk(*self.args, text, finish_reason, token_ids if self.token_ids else None,
                                    include_usage=self.include_usage, index=self.index))
        if self.token_ids:
            return b"".join((self._head, dumps(text), self._mid, dumps(token_ids or []), self._tail))
        return b"".join((self._head, dumps(text), self._mid))


def usage_chunk(kind: str, request_id: str, model: str, created: int, prompt_tokens: int,
                completion_tokens: int) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def dumps(value) -> bytes:
    """Compact JSON (orjson; the standard library for what orjson refuses: see the module docstring)."""
    try:
        out = orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":")).encode()  # ASCII: every non-ASCII character escaped
    # In valid UTF-8 these byte sequences can only be the three characters (their first bytes never
    # continue another character), so replacing bytes is replacing characters.
    if b"\xc2\x85" in out:
        out = out.replace(b"\xc2\x85", b"\\u0085")
    if b"\xe2\x80\xa8" in out or b"\xe2\x80\xa9" in out:
        out = out.replace(b"\xe2\x80\xa8", b"\\u2028").replace(b"\xe2\x80\xa9", b"\\u2029")
    return out


def sse(data: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data.encode() if isinstance(data, str) else dumps(data)
    return b"data: " + payload + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def _lp(v: float) -> float:
    return LOGPROB_FLOOR if math.isinf(v) or v < LOGPROB_FLOOR else v


def chat_logprobs(entries: list, token_text) -> dict:
    """Chat's `logprobs` ({"content": [...]}) of sampler.TokenLogprobs entries; token_text(id) -> str."""
    def one(tid: int, lp: float) -> dict:
        t = token_text(tid)
        return {"token": t, "logprob": _lp(lp), "bytes": list(t.encode("utf-8"))}

    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]}
                        for e in entries]}


def completion_logprobs(entries: list, token_text, offset: int = 0) -> dict:
    """/v1/completions' `logprobs` (tokens, token_logprobs, top_logprobs, text_offset) from `offset` on."""
    tokens, offsets = [], []
    for e in entries:
        tokens.append(token_text(e.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [_lp(e.logprob) for e in entries],
            "top_logprobs": [{token_text(t): _lp(v) for t, v in e.top} for e in entries], "text_offset": offsets}

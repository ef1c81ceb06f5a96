"""Tool calls in a model's reply: parsed into OpenAI's `tool_calls`, whole or while streaming (pure data).

A reply calls tools in one of two shapes: Hermes-style blocks
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what the fallback
system prompt of engine/tokenizer.py asks for, and what Qwen- and Hermes-style
templates produce), or, when tool_choice is `required` or names a function, the
bare JSON object `{"name": ..., "arguments": {...}}` that the grammar forces
(an array of them for `required` with parallel calls). A name that is not one
of the request's tools is left as text. With `parallel_tool_calls: false` only
the first call is kept (vLLM does the same for the calls a model writes
unconstrained).

While streaming, text that may be the start of a tool call is held back
(`ToolStream`): content before a `<tool_call>` streams as usual, and the calls
leave at the end as one `tool_calls` delta each, carrying the whole call
(OpenAI clients accumulate that the same way as a call streamed in pieces).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_OPEN = "<tool_call>"


def _call(obj: Any, names: set[str]) -> dict | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": text}}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def parse(text: str, tools: list[dict], parallel: bool = True) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole reply; content is None when the reply is only calls."""
    content, calls = _parse(text, {t["name"] for t in tools})
    return content, calls if parallel else calls[:1]


def _parse(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    stripped = text.strip()
    if stripped.startswith("{"):
        call = _call(_loads(stripped), names)
        if call is not None:
            return None, [call]
    if stripped.startswith("["):
        items = _loads(stripped)
        calls = [_call(o, names) for o in items] if isinstance(items, list) and items else [None]
        if all(c is not None for c in calls):
            return None, calls
    calls, spans = [], []
    for m in _BLOCK.finditer(text):
        call = _call(_loads(m.group(1)), names)
        if call is not None:
            calls.append(call)
            spans.append(m.span())
    if not calls:
        return text, []
    rest, at = [], 0
    for a, b in spans:
        rest.append(text[at:a])
        at = b
    rest.append(text[at:])
    content = "".join(rest).strip()
    return content or None, calls


class ToolStream:
    """Splits a streamed reply into content deltas and, at the end, tool calls."""

    def __init__(self, tools: list[dict], constrained: bool, parallel: bool = True):
        self.tools = tools
        self.parallel = parallel
        self.constrained = constrained  # the grammar makes the whole reply one call: hold all of it
        self.held = ""  # text that is, or may turn out to be, a tool call
        self.started = False  # the reply's first non-space character has been seen
        self.in_call = False  # a call has begun: everything from here on is held

    def feed(self, text: str) -> str:
        """The part of the reply so far that can go out as content now."""
        self.held += text
        if self.constrained or self.in_call:
            return ""
        if not self.started:
            head = self.held.lstrip()
            if not head:
                return ""
            self.started = True
            if head[0] in "{[":  # maybe bare JSON calls: known only when they close
                self.in_call = True
                return ""
        at = self.held.find(_OPEN)
        if at >= 0:
            out, self.held = self.held[:at], self.held[at:]
            self.in_call = True
            return out
        # Hold back a tail that could be the start of "<tool_call>".
        keep = next((k for k in range(min(len(_OPEN) - 1, len(self.held)), 0, -1)
                     if self.held.endswith(_OPEN[:k])), 0)
        cut = len(self.held) - keep
        out, self.held = self.held[:cut], self.held[cut:]
        return out

    def finish(self) -> tuple[str | None, list[dict]]:
        """(content still held, tool calls) at the end of the reply."""
        if not self.held:
            return None, []
        return parse(self.held, self.tools, self.parallel)

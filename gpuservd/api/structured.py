"""Parsing the structured-output and tool fields of a request (pure data, no I/O).

Structured output comes from OpenAI's `response_format` (`json_object`,
`json_schema`), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` and `structured_outputs`, or the field names SGLang and the
routers forward (`regex`, `ebnf`, `json_schema`); at most one per request. The
result is a plain `{"kind", "value", "field"}` dict (engine/request.py's
GuidedSpec); the engine compiles it, and a grammar that does not compile is a
400 naming `field`.
"""

from __future__ import annotations

import json
from typing import Any

from gpuservd.api.apierror import bad_request

MAX_TOOLS = 128  # OpenAI's limit on tools per request


def _schema_text(value: Any, field: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_request(f"{field} is not valid JSON: {exc.msg} at column {exc.colno}", field) from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(f"{field} must be a JSON schema (an object)", field, "invalid_type")
    return json.dumps(value)


def _string(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field} must be a non-empty string", field, "invalid_type")
    return value


def _choices(value: Any, field: str) -> str:
    if not isinstance(value, list) or not value or any(not isinstance(c, str) or not c for c in value):
        raise bad_request(f"{field} must be a non-empty array of non-empty strings", field, "invalid_type")
    return json.dumps(value)


def _response_format(rf: Any) -> dict | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("response_format must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
                          "response_format", "invalid_type")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return {"kind": "json_object", "value": "", "field": "response_format"}
    js = rf.get("json_schema")
    field = "response_format.json_schema"
    if not isinstance(js, dict) or "schema" not in js:
        raise bad_request(f"{field} must be an object with a schema (and a name)", field, "invalid_type")
    if js.get("name") is not None and not isinstance(js["name"], str):
        raise bad_request(f"{field}.name must be a string", f"{field}.name", "invalid_type")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise bad_request(f"{field}.strict must be a boolean", f"{field}.strict", "invalid_type")
    return {"kind": "json_schema", "value": _schema_text(js["schema"], f"{field}.schema"), "field": field}


# field -> (kind, how to read its value)
_GUIDED = {
    "guided_json": ("json_schema", _schema_text),
    "json_schema": ("json_schema", _schema_text),
    "guided_regex": ("regex", _string),
    "regex": ("regex", _string),
    "guided_choice": ("choice", _choices),
    "guided_grammar": ("grammar", _string),
    "ebnf": ("grammar", _string),
}
_STRUCTURED = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
GUIDED_FIELDS = set(_GUIDED) | {"response_format", "structured_outputs"}


def parse_guided(body: dict) -> dict | None:
    """The one grammar a request asks for, as {"kind", "value", "field"}, or None."""
    found = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(spec)
    for key, (kind, read) in _GUIDED.items():
        if body.get(key) is not None:
            found.append({"kind": kind, "value": read(body[key], key), "field": key})
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs", "invalid_type")
        for key, value in so.items():
            field = f"structured_outputs.{key}"
            if key in _STRUCTURED and value is not None:
                kind, read = _GUIDED[_STRUCTURED[key]]
                found.append({"kind": kind, "value": read(value, field), "field": field})
            elif key == "json_object" and value:
                found.append({"kind": "json_object", "value": "", "field": field})
            elif value not in (None, False) and key not in ("disable_fallback", "disable_any_whitespace",
                                                            "disable_additional_properties"):
                raise bad_request(f"{field} is not supported by this server", field, "unsupported_value")
    if len(found) > 1:
        names = ", ".join(f["field"] for f in found)
        raise bad_request(f"only one structured output constraint per request; got {names}", found[1]["field"])
    return found[0] if found else None


def parse_tools(body: dict) -> tuple[list[dict] | None, Any]:
    """(tools as [{"name", "description", "parameters"}], tool_choice as "none" | "auto" | "required" |
    {"name": ...}) of a chat body."""
    raw = body.get("tools")
    tools = None
    if raw is not None:
        if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
            raise bad_request(f"tools must be an array of at most {MAX_TOOLS} tools", "tools", "invalid_type")
        tools = []
        for i, t in enumerate(raw):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
                raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}",
                                  f"tools[{i}]", "invalid_type")
            name = fn.get("name")
            if not isinstance(name, str) or not name or len(name) > 64:
                raise bad_request(f"tools[{i}].function.name must be a string of 1 to 64 characters",
                                  f"tools[{i}].function.name", "invalid_type")
            params = fn.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, dict):
                raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                                  f"tools[{i}].function.parameters", "invalid_type")
            desc = fn.get("description") or ""
            if not isinstance(desc, str):
                raise bad_request(f"tools[{i}].function.description must be a string",
                                  f"tools[{i}].function.description", "invalid_type")
            tools.append({"name": name, "description": desc, "parameters": params})
        tools = tools or None
    choice = body.get("tool_choice")
    if choice is None:
        return tools, "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", "tool_choice", "invalid_type")
        if not tools or name not in {t["name"] for t in tools}:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")
        return tools, {"name": name}
    if choice not in ("none", "auto", "required"):
        raise bad_request("tool_choice must be none, auto, required or a named function", "tool_choice")
    if choice == "required" and not tools:
        raise bad_request("tool_choice is required but no tools are given", "tool_choice")
    return tools, choice


def tool_call_schema(tools: list[dict], choice: Any, parallel: bool = True) -> dict:
    """The JSON schema a constrained reply follows. A named tool (tool_choice {"name": ...}): exactly one
    call {"name", "arguments"} of it, as OpenAI forces that function. tool_choice "required": calls of any
    of the tools, as a JSON array of one or more when parallel_tool_calls is on (OpenAI's default; vLLM
    builds the same array), else one call."""
    named = [t for t in tools if isinstance(choice, dict) and t["name"] == choice["name"]] or tools
    options = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False} for t in named]
    one = options[0] if len(options) == 1 else {"anyOf": options}
    if choice == "required" and parallel:
        return {"type": "array", "items": one, "minItems": 1}
    return one

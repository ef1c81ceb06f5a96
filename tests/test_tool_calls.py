"""Tool calls without the daemon: rendering through a template (or the fallback prompt), parsing replies
whole and streamed, and the schema that constrains a required or named call."""

from __future__ import annotations

import json

import jsonschema
import pytest

from factories import make_tokenizer
from gpuservd.api import structured, tools
from gpuservd.engine.tokenizer import encode_chat

TOOLS = [{"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"name": "add", "description": "", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
HISTORY = [{"role": "user", "content": "weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
           {"role": "tool", "content": "rain, 4 C", "tool_call_id": "call_1"}]
# A template that renders tools itself, as Qwen's and Hermes' do.
TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<call>{{ c.function.arguments | tojson }}</call>{% endfor %}"
    "</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def render(tok, history, tool_list=None, template_kwargs=None) -> str:
    return tok.decode(encode_chat(tok, history, tool_list, template_kwargs), skip_special_tokens=False)


def test_template_without_tools_gets_the_fallback_prompt(tok):
    text = render(tok, HISTORY, TOOLS)
    assert '"name": "get_weather"' in text and "<tool_call>" in text  # the tools, and how to call them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nrain, 4 C\n</tool_response>" in text
    plain = render(tok, HISTORY[:1])
    assert "<tools>" not in plain and "<tool_call>" not in plain


def test_template_with_tools_renders_them_and_call_arguments_as_objects(tok):
    tok.chat_template, saved = TOOL_TEMPLATE, tok.chat_template
    try:
        text = render(tok, HISTORY, TOOLS)
    finally:
        tok.chat_template = saved
    assert text.startswith("<tools>") and '"get_weather"' in text
    assert '<call>{"city": "Oslo"}</call>' in text  # not a JSON string quoted again
    assert "<tool>rain, 4 C</tool>" in text and "<tool_call>" not in text


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_messages(tok):
    tok.chat_template, saved = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}", tok.chat_template
    try:
        assert render(tok, HISTORY[:1], None, {"greeting": "HEY ", "messages": []}) == "HEY weather in Oslo?"
    finally:
        tok.chat_template = saved


def test_parse_blocks_bare_json_and_plain_text():
    content, calls = tools.parse('Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>',
                                 TOOLS)
    assert content == "Let me look." and calls[0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    content, calls = tools.parse('{"name": "get_weather", "arguments": {"city": "Rome"}}', TOOLS)
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome"}
    assert tools.parse('{"name": "unknown", "arguments": {}}', TOOLS)[1] == []  # not one of the tools: text
    assert tools.parse("just words <b>", TOOLS) == ("just words <b>", [])


@pytest.mark.parametrize("pieces", [
    ["Sure", ", one moment.", "<tool", "_call>\n", '{"name": "add", "arguments": {"a": 1}}', "\n</tool_call>"],
    ["Sure, one moment.<tool_call>", '{"name": "add",', ' "arguments": {"a": 1}}</tool_call>'],
])
def test_stream_holds_back_only_what_may_be_a_call(pieces):
    s = tools.ToolStream(TOOLS, constrained=False)
    out = "".join(s.feed(p) for p in pieces)
    content, calls = s.finish()
    assert out == "Sure, one moment." and content is None
    assert [c["function"]["name"] for c in calls] == ["add"]
    plain = tools.ToolStream(TOOLS, constrained=False)
    assert plain.feed("Hello <") + plain.feed("b> there") == "Hello <b> there" and plain.finish() == (None, [])


def test_constrained_schema_accepts_only_a_call_of_the_chosen_tools():
    named = structured.tool_call_schema(TOOLS, {"name": "add"})
    jsonschema.validate({"name": "add", "arguments": {"a": 3}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "x"}}, named)
    either = structured.tool_call_schema(TOOLS, "required", parallel=False)
    calls = [{"name": "add", "arguments": {"a": 3}}, {"name": "get_weather", "arguments": {"city": "x"}}]
    for call in calls:
        jsonschema.validate(call, either)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {}}, either)
    # parallel_tool_calls (on by default): one or more calls, as a JSON array; a named tool stays one call.
    several = structured.tool_call_schema(TOOLS, "required")
    jsonschema.validate(calls, several)
    jsonschema.validate(calls[:1], several)
    for bad in ([], calls[0], [calls[0], {"name": "get_weather", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, several)
    assert structured.tool_call_schema(TOOLS, {"name": "add"}, parallel=True) == named


def test_parse_an_array_of_calls_and_parallel_off_keeps_the_first():
    text = json.dumps([{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"city": "R"}}])
    content, calls = tools.parse(text, TOOLS)
    assert content is None and [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    assert [c["function"]["name"] for c in tools.parse(text, TOOLS, parallel=False)[1]] == ["add"]
    assert tools.parse('[{"name": "nope", "arguments": {}}]', TOOLS)[1] == []  # not all calls: text
    assert tools.parse("[1, 2]", TOOLS) == ("[1, 2]", [])
    stream = tools.ToolStream(TOOLS, constrained=False, parallel=False)
    assert stream.feed(text[:10]) + stream.feed(text[10:]) == ""
    assert [c["function"]["name"] for c in stream.finish()[1]] == ["add"]

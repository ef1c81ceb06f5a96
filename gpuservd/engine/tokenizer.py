"""The model's tokenizer and chat template, from its store directory."""

from __future__ import annotations

import json
from pathlib import Path

from gpuservd.errors import StoreCorrupt, UserError


def load_tokenizer(model_dir: Path):
    """A fast tokenizer from the store directory (no hub access)."""
    # Every store model has a tokenizer.json, so the fast class is loaded directly:
    # AutoTokenizer's class resolution costs about a second more. Imported here: the chat helpers below
    # serve callers that never load a tokenizer, and transformers takes seconds to import.
    from transformers import PreTrainedTokenizerFast

    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise StoreCorrupt(f"{path}: missing; the model has no tokenizer")
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)


# How tools are offered to a model whose chat template does not render them (SmolLM2's, for one): a
# system prompt in the Hermes format many instruction-tuned models have seen, and the replies parsed the
# same way (api/tools.py). Earlier tool calls and results go into the conversation in that format too.
TOOL_SYSTEM_PROMPT = (
    "You may call one or more functions to answer. The functions, as JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with one block per call and nothing else:\n<tool_call>\n"
    '{{"name": <function name>, "arguments": <the arguments as a JSON object>}}\n</tool_call>'
)
# Template variables a client's chat_template_kwargs may not override.
_RESERVED = {"messages", "tools", "add_generation_prompt", "tokenize", "return_dict", "continue_final_message"}


def _renders_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _call_text(call: dict) -> str:
    fn = call["function"]
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except json.JSONDecodeError:
        args = fn.get("arguments")
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": args}) + "\n</tool_call>"


def _arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Earlier tool calls with their arguments as objects: templates that render tools write them with
    `tojson`, which would quote a JSON string a second time (vLLM passes objects too)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                try:
                    args = json.loads(c["function"].get("arguments") or "{}")
                except json.JSONDecodeError:
                    args = c["function"].get("arguments")
                calls.append({**c, "function": {**c["function"], "arguments": args}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _with_tool_prompt(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The conversation for a template without tool support: the tools in a system prompt, earlier calls
    as <tool_call> text, tool results as <tool_response> user turns."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            text = "\n".join([m["content"]] * bool(m["content"]) + [_call_text(c) for c in m["tool_calls"]])
            out.append({"role": "assistant", "content": text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        listing = "\n".join(json.dumps({"type": "function", "function": t}) for t in tools)
        prompt = TOOL_SYSTEM_PROMPT.format(tools=listing)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """Token ids of a conversation through the model's chat template, ready for the reply. Tools go through
    the template when it renders them, else through TOOL_SYSTEM_PROMPT."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("this model has no chat template; send a raw prompt instead (--raw)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise UserError(f"messages[{i}].role must be one of system, user, assistant, tool")
        if not isinstance(m.get("content"), str):
            raise UserError(f"messages[{i}].content must be a string")
    extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED}
    has_tool_turns = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if _renders_tools(tokenizer):
        wrapped = [{"type": "function", "function": t} for t in tools] if tools else None
        text = tokenizer.apply_chat_template(_arguments_as_objects(messages), tools=wrapped, add_generation_prompt=True, tokenize=False,
                                             **extra)
    else:
        if tools or has_tool_turns:
            messages = _with_tool_prompt(messages, tools)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_raw(tokenizer, text: str) -> list[int]:
    """Token ids of plain text (with the BOS the tokenizer adds, if any)."""
    return tokenizer.encode(text)

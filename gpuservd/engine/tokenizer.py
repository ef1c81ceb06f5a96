"""The model's tokenizer and chat template, from its store directory."""

from __future__ import annotations

from pathlib import Path

from gpuservd.errors import StoreCorrupt, UserError


def load_tokenizer(model_dir: Path):
    """A fast tokenizer from the store directory (no hub access)."""
    # Every store model has a tokenizer.json, so the fast class is loaded directly:
    # AutoTokenizer's class resolution costs about a second more.
    from transformers import PreTrainedTokenizerFast

    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        raise StoreCorrupt(f"{path}: missing; the model has no tokenizer")
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a conversation through the model's chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("this model has no chat template; send a raw prompt instead (--raw)")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise UserError(f"messages[{i}].role must be one of system, user, assistant, tool")
        if not isinstance(m.get("content"), str):
            raise UserError(f"messages[{i}].content must be a string")
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def encode_raw(tokenizer, text: str) -> list[int]:
    """Token ids of plain text (with the BOS the tokenizer adds, if any)."""
    return tokenizer.encode(text)

"""Rebuild a Hugging Face fast tokenizer from a GGUF file's tokenizer metadata.

A GGUF carries the vocabulary, merges, token types, special ids and chat template
under llama.cpp's key names, but no tokenizer.json. For byte-level BPE vocabularies
(`tokenizer.ggml.model == "gpt2"`) with a pre-tokenizer we know, we build the
tokenizer directly with the `tokenizers` library: it takes well under a second,
where transformers' GGUF path re-parses the whole file (~8 s for SmolLM2), and
transformers has no split rule for SmolLM's "smollm" pre-tokenizer (llama.cpp
splits digits one by one there). Any other vocabulary falls back to transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL = 3
_USER_DEFINED = 4

# Pre-tokenizers we rebuild ourselves: llama.cpp pre type -> tokenizers pipeline.
# Both are GPT-2's regex; "smollm" first isolates every digit (llama-vocab.cpp
# LLAMA_VOCAB_PRE_TYPE_SMOLLM), as SmolLM's own tokenizer.json does.
_PRE_TOKENIZERS = {
    "gpt2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    "smollm": lambda: pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    ),
}


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's reversible byte -> printable character table (every byte-level BPE uses it).
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def can_build(meta: dict) -> bool:
    """Whether `build_tokenizer` handles this file's vocabulary without transformers."""
    return meta.get("tokenizer.ggml.model") == "gpt2" and meta.get("tokenizer.ggml.pre", "gpt2") in _PRE_TOKENIZERS


def build_tokenizer(meta: dict) -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from GGUF metadata (see `can_build`)."""
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    tokens = list(meta["tokenizer.ggml.tokens"])
    # llama.cpp keeps byte-level spelling ("Ġthe"); respell any token stored as raw text.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _PRE_TOKENIZERS[meta.get("tokenizer.ggml.pre", "gpt2")]()
    tokenizer.decoder = decoders.ByteLevel()
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    # Control and user-defined tokens must match whole, never be cut into bytes.
    special = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == _CONTROL]
    plain = [AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    return tokenizer


def _token(meta: dict, key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else meta["tokenizer.ggml.tokens"][token_id]


def write_tokenizer(meta: dict, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json (with chat_template) and special_tokens_map.json."""
    build_tokenizer(meta).save(str(out_dir / "tokenizer.json"))
    specials = {
        "bos_token": _token(meta, "bos_token_id"),
        "eos_token": _token(meta, "eos_token_id"),
        "unk_token": _token(meta, "unknown_token_id"),
        "pad_token": _token(meta, "padding_token_id"),
    }
    specials = {k: v for k, v in specials.items() if v is not None}
    config = {
        # The generic class loads tokenizer.json as written, in transformers 4 and 5 alike.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False) + "\n")


def write_tokenizer_via_transformers(gguf_path: Path, out_dir: Path) -> None:
    """Fallback for vocabularies we do not rebuild: transformers' own GGUF tokenizer path (slow)."""
    from transformers import AutoTokenizer  # heavy; only this path needs it

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))

"""Convert a llama-architecture GGUF file into a Hugging Face directory (fp32 safetensors).

We read tensors with the `gguf` package and dequantise them with numpy rather than
going through transformers' GGUF loader: that one needs accelerate, takes ~25 s for
SmolLM2 (Python parsing of the metadata, twice) and must be told to dequantise
before it can save. No torch is needed here either.

llama.cpp's converter permutes the rows of attn_q / attn_k so that rotary pairs
are interleaved (GGML's rope) instead of split in halves (HF's rotate_half); we undo
it here, exactly as transformers' LlamaTensorProcessor._reverse_permute_weights does.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file

from gpuservd.errors import UserError
from gpuservd.store import gguf_tokenizer

# llama.cpp tensor name -> HF name; blk.N.* go under model.layers.N.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")


@dataclass
class ConversionResult:
    """What convert_gguf wrote."""

    num_tensors: int  # tensors written to model.safetensors
    num_parameters: int  # their elements
    config: dict  # the config.json written
    seconds: float  # wall time of the conversion


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its transformers Llama name; UserError if unknown."""
    match = _BLOCK_RE.match(gguf_name)
    if match and match[2] in _BLOCK_NAMES:
        return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"
    match = _GLOBAL_RE.match(gguf_name)
    if match and match[1] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match[1]]}.{match[2]}"
    raise UserError(f"GGUF tensor {gguf_name!r} has no Llama equivalent; this file is not supported")


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (HF halves -> interleaved pairs); tests use it to build files."""
    # w: [n_head * head_dim, in] (or [n_head * head_dim] for a bias)
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo permute_rows: llama.cpp's interleaved rotary rows back to HF's halves."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(reader) -> dict:
    """Every GGUF key/value as plain Python values (strings, numbers, lists)."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _f32(value: float) -> float:
    # GGUF stores floats as float32; 9.999999747e-06 should read back as the 1e-05 it was.
    return float(str(np.float32(value)))


def build_config(meta: dict, vocab_size: int, tied: bool) -> dict:
    """config.json for LlamaForCausalLM from `llama.*` metadata."""
    arch = meta["general.architecture"]
    if arch != "llama":
        raise UserError(f"GGUF architecture {arch!r} is not supported; only 'llama' files convert")
    if meta.get("llama.rope.scaling.type", "none") not in ("none", None):
        raise UserError(f"GGUF rope scaling {meta['llama.rope.scaling.type']!r} is not supported")
    hidden = int(meta["llama.embedding_length"])
    n_head = int(meta["llama.attention.head_count"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", n_head)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // n_head)),
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            config[key.replace("padding", "pad")] = int(meta[f"tokenizer.ggml.{key}"])
    return config


def _generation_config(config: dict) -> dict:
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}


def _dequantized(tensor) -> np.ndarray:
    # GGUF lists dims innermost first; HF wants [out, in].
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)


def convert_gguf(gguf_path: Path, out_dir: Path, with_tokenizer: bool = True,
                 progress: Callable[[str], None] | None = None) -> ConversionResult:
    """Write config.json, generation_config.json, model.safetensors (fp32) and tokenizer files.

    `with_tokenizer=False` skips the tokenizer (for files that carry none); `progress`
    is called with one line per stage.
    """
    say = progress or (lambda line: None)
    start = time.perf_counter()
    try:
        reader = GGUFReader(str(gguf_path))
    except (ValueError, KeyError, IndexError, TypeError, OSError) as exc:
        raise UserError(f"{gguf_path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    meta = read_metadata(reader)
    if with_tokenizer and "tokenizer.ggml.model" not in meta:
        raise UserError(f"{gguf_path}: carries no tokenizer")
    names = {t.name for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise UserError(f"{gguf_path}: no token_embd.weight tensor; not a llama model file")
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config = build_config(meta, vocab_size=int(embd.shape[1]), tied="output.weight" not in names)
    say(f"read {gguf_path.name}: {len(reader.tensors)} tensors, {config['num_hidden_layers']} layers "
        f"({time.perf_counter() - start:.1f} s)")

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        hf_name = hf_tensor_name(tensor.name)
        weights = _dequantized(tensor)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if kind in heads:
            weights = unpermute_rows(weights, heads[kind])
        tensors[hf_name] = np.ascontiguousarray(weights)
    num_parameters = sum(int(w.size) for w in tensors.values())
    say(f"dequantised {num_parameters / 1e6:.1f}M parameters to float32 ({time.perf_counter() - start:.1f} s)")

    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(_generation_config(config), indent=2) + "\n")
    say(f"wrote model.safetensors ({time.perf_counter() - start:.1f} s)")

    if with_tokenizer:
        if gguf_tokenizer.can_build(meta):
            gguf_tokenizer.write_tokenizer(meta, out_dir, config["max_position_embeddings"])
        else:
            gguf_tokenizer.write_tokenizer_via_transformers(gguf_path, out_dir)
        say(f"wrote tokenizer ({time.perf_counter() - start:.1f} s)")
    return ConversionResult(
        num_tensors=len(tensors), num_parameters=num_parameters, config=config,
        seconds=time.perf_counter() - start,
    )

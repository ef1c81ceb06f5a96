"""The architecture of a Llama-family model, read from its config.json.

One dataclass covers Llama 2/3, Mistral, Qwen2 and SmolLM: they differ only in
fields (GQA head counts, qkv bias, rope scaling, tied embeddings, sliding
window). Anything we do not implement is refused here with a clear error,
never silently run wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gpuservd.errors import StoreCorrupt, UserError
from gpuservd.store.layout import SUPPORTED_ARCHITECTURES, check_config_numbers

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelArch:
    """Shapes and constants of one Llama-family model."""

    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when < num_heads)
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # HF's rope_scaling / rope_parameters dict, or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 has biases on q/k/v projections
    sliding_window: int | None  # Mistral; None = full attention
    eos_token_ids: tuple[int, ...]  # from config.json / generation_config.json
    bos_token_id: int | None


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def load_arch(model_dir: Path) -> ModelArch:
    """Read config.json (and generation_config.json for EOS ids) from a model directory."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreCorrupt(f"{path}: missing; the model directory is incomplete") from None
    except json.JSONDecodeError as exc:
        raise StoreCorrupt(f"{path}: not valid JSON ({exc})") from None
    return arch_from_dict(cfg, model_dir=Path(model_dir), source=str(path))


def arch_from_dict(cfg: dict, model_dir: Path | None = None, source: str = "config") -> ModelArch:
    """Build a ModelArch from a config dict; raise StoreCorrupt/UserError naming what is wrong."""
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"{source}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in cfg]
    if missing:
        raise StoreCorrupt(f"{source}: missing field(s) {', '.join(missing)}")
    check_config_numbers(cfg, source)  # before any size below reaches an allocation
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    # transformers 5 moved rope settings into rope_parameters; 4.x used rope_theta + rope_scaling.
    rope_params = cfg.get("rope_parameters") or {}
    rope_scaling = cfg.get("rope_scaling") or None
    if rope_params and rope_params.get("rope_type", "default") != "default":
        rope_scaling = rope_params
    rope_theta = float(cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0)
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UserError(
                f"{source}: rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
    eos = _as_tuple(cfg.get("eos_token_id"))
    if model_dir is not None:
        gen_path = model_dir / "generation_config.json"
        if gen_path.exists():
            try:
                eos = _as_tuple(json.loads(gen_path.read_text()).get("eos_token_id")) or eos
            except json.JSONDecodeError as exc:
                raise StoreCorrupt(f"{gen_path}: not valid JSON ({exc})") from None
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return ModelArch(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
        sliding_window=int(sliding) if sliding else None,
        eos_token_ids=eos,
        bos_token_id=cfg.get("bos_token_id"),
    )

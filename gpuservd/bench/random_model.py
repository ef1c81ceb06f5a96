"""A random-weight Llama of a chosen size, written straight into the model store.

The isolation benchmark needs a best-effort model several times larger than
SmolLM2 (no model hub at run time), so it makes one: HF Llama tensor names,
weights drawn from N(0, 0.02) (what an untrained model would have), SmolLM2's
tokenizer copied beside them so both models read the same prompts. The store
writes it atomically like any import, so a run killed half way leaves nothing.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from gpuservd.errors import UserError


@dataclass
class LlamaShape:
    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    vocab_size: int = 49152
    torch_dtype: str = "float32"  # as written to the store

    def num_parameters(self) -> int:
        h, kv = self.hidden_size, self.hidden_size * self.num_key_value_heads // self.num_attention_heads
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        return self.num_hidden_layers * per_layer + self.vocab_size * h + h  # tied lm_head


# SmolLM2-135M's shape: a stand-in for it where it cannot be pulled (a GPU machine without network).
SMOLLM2_SHAPE = LlamaShape(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, vocab_size=49152)
# TinyLlama-1.1B's shape (SmolLM2's vocabulary), stored in bf16 like most released checkpoints: a cold
# load big enough that reading it from the disk takes longer than the engine's own set-up.
COLD_1B_SHAPE = LlamaShape(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, vocab_size=49152, torch_dtype="bfloat16")
RANDOM_MODELS = {"isolation-big": LlamaShape(), "isolation-small": SMOLLM2_SHAPE, "cold-1b": COLD_1B_SHAPE}


def _byte_level_tokenizer(path) -> None:
    """A small byte-level BPE with ChatML's special tokens (ids 0-2, as in SmolLM2), trained in-process:
    the benchmarks send token ids, so only the special tokens and a working decoder matter."""
    # only when a tokenizer is trained: transformers takes seconds to import
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog 0123456789"] * 8,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                          "{% endif %}")
    fast.save_pretrained(path)


def ensure_random_llama(store, name: str, shape: LlamaShape, tokenizer_from: str | None = None, seed: int = 0) -> str:
    """Write `name` into the store unless it is there with this shape; returns the name. The tokenizer is
    `tokenizer_from`'s when that model is in the store, else a small trained byte-level BPE."""
    if name in store.names():
        cfg = json.loads((store.path(name) / "config.json").read_text())
        if all(cfg.get(k) == v for k, v in shape.__dict__.items()):
            return name
        raise UserError(f"model {name} is in the store with another shape; remove it (gpuserv models rm {name})")

    src = store.path(tokenizer_from) if tokenizer_from and tokenizer_from in store.names() else None
    with store.staging(name, source=f"random:{shape.num_parameters()}") as tmp:
        if src is not None:
            for f in src.iterdir():
                if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
                    shutil.copy(f, tmp / f.name)
            base = json.loads((src / "config.json").read_text())
        else:
            _byte_level_tokenizer(tmp)
            base = {"bos_token_id": 1, "eos_token_id": 2}
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                  "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                  "tie_word_embeddings": True,
                  "bos_token_id": base.get("bos_token_id", 1), "eos_token_id": base.get("eos_token_id", 2),
                  **shape.__dict__}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        g = torch.Generator().manual_seed(seed)
        h, kv = shape.hidden_size, shape.hidden_size * shape.num_key_value_heads // shape.num_attention_heads

        dtype = getattr(torch, shape.torch_dtype)

        def w(*size):
            return torch.randn(*size, generator=g).mul_(0.02).to(dtype)

        tensors = {"model.embed_tokens.weight": w(shape.vocab_size, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
        for i in range(shape.num_hidden_layers):
            p = f"model.layers.{i}."
            tensors.update({p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
                          p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
                          p + "mlp.gate_proj.weight": w(shape.intermediate_size, h),
                          p + "mlp.up_proj.weight": w(shape.intermediate_size, h),
                          p + "mlp.down_proj.weight": w(h, shape.intermediate_size),
                          p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                          p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype)})
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return name

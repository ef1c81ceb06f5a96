"""Small factories shared by the tests: tiny random Llama-family models on disk.

Every model here is built in-process from a random config (seconds on a CPU);
nothing comes from a hub.
"""

from __future__ import annotations

from pathlib import Path

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def make_hf_model(path: Path, arch: str = "llama", seed: int = 0, **overrides):
    """Save a random tiny model of the given family (llama | mistral | qwen2) to path; returns the HF model."""
    import torch
    import transformers

    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]
    kwargs = dict(TINY)
    kwargs.update(overrides)
    config = cfg_cls(**kwargs)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return model

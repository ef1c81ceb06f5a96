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


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "the capital of france is paris and the capital of italy is rome",
    "a quick brown fox jumps over the lazy dog while the cat sleeps",
    "serving many models on one card keeps tail latency flat under mixed traffic",
] * 20


def make_tokenizer(path: Path, vocab_size: int = 300):
    """Train a tiny byte-level BPE in-process and save it (with a ChatML template) to path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHATML
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return fast


def make_model_dir(path: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A complete tiny model directory: random weights + a trained tokenizer with a chat template."""
    make_hf_model(path, arch, seed=seed, **overrides)
    make_tokenizer(path)
    return path


def arrive_and_cancel(s, requests: list, arrivals: dict, cancel, step: int, done: list) -> None:
    """A scheduler test's traffic at one step: requests whose arrival step it is join the scheduler; at
    step 2 the requests numbered in `cancel` that are still queued or running go away (a client leaves)."""
    for i, r in enumerate(requests):
        if arrivals[i] == step:
            s.add(r)
    if step == 2:
        for i in cancel:
            if i < len(requests) and requests[i] not in done and (requests[i] in s.running or requests[i] in s.waiting):
                s.remove(requests[i])
                done.append(requests[i])


def run_requests(eng, prompts: list, params: list) -> list[list[int]]:
    """Add prompts[i] with params[i] as request r{i}, step the engine until all finish; each one's token ids."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [got[f"r{i}"] for i in range(len(prompts))]

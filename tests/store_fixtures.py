"""Factories for store tests: a tiny byte-level BPE tokenizer, a tiny random Llama
directory in Hugging Face layout, and a tiny llama GGUF written the llama.cpp way.

Kept out of conftest.py on purpose (other test modules own that file); import these.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Hello world! Numbers like 12345 and 2024 are split into digits.",
    "def main():\n    return 42  # the answer\n",
    "paged attention, continuous batching, preemption and swap",
] * 20

TINY_DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0)


def make_tokenizer():
    """A trained byte-level BPE (~300 tokens) with SmolLM2's pre-tokenizer (digits isolated)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return tokenizer


def make_config(vocab_size: int, tie: bool = True, architecture: str = "LlamaForCausalLM"):
    """A tiny LlamaConfig (2 layers, hidden 64, 4 heads, 2 KV heads)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
                       pad_token_id=2, architectures=[architecture], **TINY_DIMS)


def make_model_dir(path: Path, tie: bool = True, max_shard_size: str | None = None, seed: int = 0):
    """Save a random tiny Llama and its tokenizer in HF layout at `path`; return the model."""
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    model = LlamaForCausalLM(make_config(tokenizer.get_vocab_size(), tie=tie)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                      pad_token="<|im_end|>", unk_token="<|endoftext|>")
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(path)
    return model


def tokenizer_metadata(tokenizer) -> dict:
    """The tokenizer.ggml.* lists llama.cpp's converter would write for this tokenizer."""
    data = json.loads(tokenizer.to_str())
    vocab = data["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]  # 3: CONTROL, 1: NORMAL
    return {"tokens": tokens, "merges": merges, "types": types}


def write_tiny_gguf(path: Path, state_dict: dict, config, tokenizer=None, quantized: str = "blk.0.ffn_up.weight"):
    """Write `state_dict` (HF names, fp32 tensors) as a llama GGUF, the way llama.cpp does.

    Q/K rows are permuted (rotary pairs interleaved); `quantized` is stored as Q8_0,
    everything else as F32. Returns {gguf tensor name: array as stored before quantising}.
    """
    import gguf
    from gpuservd.store.gguf_convert import permute_rows

    hf_to_gguf = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "lm_head.weight": "output.weight"}
    block = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    if tokenizer is not None:
        meta = tokenizer_metadata(tokenizer)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("smollm")
        writer.add_token_list(meta["tokens"])
        writer.add_token_types(meta["types"])
        writer.add_token_merges(meta["merges"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_pad_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    stored = {}
    for hf_name, tensor in state_dict.items():
        array = tensor.detach().cpu().numpy().astype(np.float32)
        if hf_name in hf_to_gguf:
            name = hf_to_gguf[hf_name]
        else:
            _, _, layer, module, *rest = hf_name.split(".")
            name = f"blk.{layer}.{block[module + '.' + rest[0]] if rest[0] != 'weight' else block[module]}.weight"
            if name.endswith("attn_q.weight"):
                array = permute_rows(array, config.num_attention_heads)
            elif name.endswith("attn_k.weight"):
                array = permute_rows(array, config.num_key_value_heads)
        stored[name] = array
        if name == quantized:
            writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored

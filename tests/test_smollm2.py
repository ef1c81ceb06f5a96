"""The real default model: our engine's greedy output equals transformers', token for token."""

from __future__ import annotations

import pytest
import torch

from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.engine.tokenizer import encode_chat

pytestmark = [pytest.mark.smollm2, pytest.mark.slow]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a GPU is in one sentence.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci and describe it in detail, please, with its history.",
    "Hi",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def engine_and_hf(smollm2_dir):
    from transformers import LlamaForCausalLM

    torch.set_num_threads(2)
    hf = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    eng = LLMEngine("smollm2", smollm2_dir, EngineConfig(dtype="float32", kv_cache_bytes=256 << 20))
    return eng, hf


def hf_greedy(hf, prompts: list[list[int]], proposed: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, checked against its `proposed` in one forward pass.

    Greedy decoding picks the argmax after each prefix, so one forward over prompt + proposed gives, at
    every position, the token transformers' generate would pick there. The continuation is read off up to
    the first position where it parts from proposed (or the first EOS, or NEW_TOKENS), which is exactly
    generate(do_sample=False, max_new_tokens=NEW_TOKENS): equal to proposed only when every token of it
    is transformers' pick and it stops where transformers stops. A token-by-token generate costs
    NEW_TOKENS batch-1 forwards per prompt for the same answer.

    All sequences go through one forward, right-padded to the longest: under the causal mask a position
    sees only the positions before it, so a row's real positions are computed from its own tokens alone
    (the pads only follow them). One forward instead of one per prompt also saves transformers' CPU
    matmuls their first-call cost at each new sequence length, which was most of this module's time.
    """
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    seqs = [p + q for p, q in zip(prompts, proposed)]
    width = max(map(len, seqs))
    pad = hf.config.pad_token_id if hf.config.pad_token_id is not None else 0
    with torch.no_grad():
        picks = hf(torch.tensor([s + [pad] * (width - len(s)) for s in seqs])).logits.argmax(-1)
    outs = []
    for row, p, q in zip(picks.tolist(), prompts, proposed):
        out: list[int] = []
        for i, tok in enumerate(row[len(p) - 1:len(p) - 1 + NEW_TOKENS]):
            out.append(tok)
            if tok in eos or i >= len(q) or tok != q[i]:
                break  # generate stops at EOS; past a difference the prefix is no longer transformers' own
        outs.append(out)
    return outs


def test_greedy_matches_transformers_alone_and_batched(engine_and_hf):
    eng, hf = engine_and_hf
    prompts = [encode_chat(eng.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    assert len({len(p) for p in prompts}) > 4  # mixed lengths
    # Natural stops on both sides: HF's min_new_tokens would mask EOS, which is not the same as ignoring it.
    params = SamplingParams(max_tokens=NEW_TOKENS, detokenize=False)
    batched = eng.generate(prompts, params)
    alone = [eng.generate([p], params)[0] for p in prompts[:3]]
    assert alone == batched[:3]
    for p, got, ref in zip(prompts, batched, hf_greedy(hf, prompts, batched)):
        assert got == ref, eng.tokenizer.decode(p)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_logits_match_transformers(engine_and_hf):
    from gpuservd.runner.batch import SeqChunk, build_batch

    eng, hf = engine_and_hf
    ids = encode_chat(eng.tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    blocks = eng.pool.allocate(-(-len(ids) // eng.config.block_size))
    try:
        batch = build_batch([SeqChunk(ids, 0, blocks, True)], eng.config.block_size, torch.device("cpu"))
        got = eng.runner.model.forward(batch, eng.runner.cache.layer)[0]
    finally:
        eng.pool.free(blocks)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-4)


def test_reply_is_sensible(engine_and_hf):
    eng, _ = engine_and_hf
    ids = encode_chat(eng.tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    text = "".join(o.new_text for o in eng.stream("paris", ids, SamplingParams(max_tokens=20)))
    assert "Paris" in text

"""Prompt logprobs from the prefill's logits: against transformers' own model on the same weights, the same
under chunked prefill, and complete for a prompt whose prefix is in the prefix cache."""

from __future__ import annotations

import pytest
import torch

from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.errors import FieldError

PROMPT = [5, 17, 99, 3, 250, 41, 41, 7, 180, 66, 12, 9, 140, 201, 33, 8, 77, 64, 5, 2, 300]


def engine(model_dir, **sched) -> LLMEngine:
    # fp32 as the transformers reference (auto is bf16 on an AVX512_BF16 CPU)
    cfg = EngineConfig(model="tiny", block_size=4, kv_cache_bytes=4 << 20, num_threads=1, prefix_caching=True,
                       dtype="float32")
    for k, v in sched.items():
        setattr(cfg.scheduler, k, v)
    return LLMEngine("tiny", model_dir, cfg)


def reference(model_dir, prompt, k):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    picked = [float(lp[p - 1, prompt[p]]) for p in range(1, len(prompt))]
    tops = [torch.topk(lp[p - 1], k).indices.tolist() for p in range(1, len(prompt))]
    return picked, tops


def run(eng, rid, prompt, **params):
    outs = list(eng.stream(rid, prompt, SamplingParams(max_tokens=2, detokenize=False, **params)))
    firsts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(firsts) <= 1  # handed out once, with the first output
    return firsts[0] if firsts else None, outs


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return reference(tiny_model_dir, PROMPT, 3)


def check(entries, ref):
    picked, tops = ref
    assert entries[0] is None and len(entries) == len(PROMPT)
    for p, e in enumerate(entries[1:], start=1):
        assert e.token_id == PROMPT[p]
        assert e.logprob == pytest.approx(picked[p - 1], abs=2e-4)
        assert [t for t, _ in e.top] == tops[p - 1] or abs(e.top[1][1] - e.top[2][1]) < 1e-4


def test_prompt_logprobs_match_transformers(tiny_model_dir, ref):
    eng = engine(tiny_model_dir)
    entries, outs = run(eng, "a", PROMPT, prompt_logprobs=3)
    check(entries, ref)
    assert outs[0].prompt_logprobs is entries  # on the first output
    plain, _ = run(eng, "b", PROMPT)  # not asked: none
    assert plain is None
    assert eng.pool.num_used == 0


def test_chunked_prefill_gives_the_same_prompt_logprobs(tiny_model_dir, ref):
    eng = engine(tiny_model_dir, max_prefill_tokens=6, max_num_batched_tokens=8, max_num_seqs=8)
    entries, _ = run(eng, "c", PROMPT, prompt_logprobs=3)
    check(entries, ref)
    assert max(r.num_prefill_tokens for r in eng.telemetry.recent()) <= 6  # it was chunked


def test_a_cached_prefix_still_gets_every_prompt_logprob(tiny_model_dir, ref):
    eng = engine(tiny_model_dir)
    def hit_tokens(rid, **params):
        before = eng.telemetry.num_steps
        entries, _ = run(eng, rid, PROMPT, **params)
        recs = eng.telemetry.recent(eng.telemetry.num_steps - before)
        return entries, sum(r.num_prefix_hit_tokens for r in recs), sum(r.num_prefill_tokens for r in recs)

    hit_tokens("warm")  # its full blocks are now cached
    entries, hits, prefilled = hit_tokens("again", prompt_logprobs=3)
    check(entries, ref)
    assert hits == 0 and prefilled == len(PROMPT)  # it computed its whole prompt
    _, hits, prefilled = hit_tokens("plain")  # a request without prompt logprobs still uses the cache
    assert hits == 20


def test_prompt_logprobs_bounds_name_the_field():
    with pytest.raises(FieldError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21).validate()

"""The engine end to end on a tiny model: exact greedy output, stops, sampling, cleanup."""

from __future__ import annotations

import pytest
import torch

from gpuservd.config import EngineConfig, PreemptionConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import FinishReason, SamplingParams
from gpuservd.engine.tokenizer import encode_chat
from gpuservd.errors import UserError


def make_engine(model_dir, **kw) -> LLMEngine:
    sched = kw.pop("scheduler", {})
    kw.setdefault("dtype", "float32")  # compared with transformers' fp32 model: not engine.dtype auto
    cfg = EngineConfig(model="tiny", kv_cache_bytes=kw.pop("kv_cache_bytes", 4 << 20), block_size=4, **kw)
    for k, v in sched.items():
        setattr(cfg.scheduler, k, v)
    return LLMEngine("tiny", model_dir, cfg)


def run_all(engine):
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_greedy_batched_equals_transformers(tiny_model_dir):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    eng = make_engine(tiny_model_dir, scheduler=dict(max_prefill_tokens=16))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 290, (n,), generator=g).tolist() for n in (1, 7, 33, 12, 50, 3)]
    got = eng.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True, detokenize=False))
    for p, o in zip(prompts, got):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert o == ref[0, len(p):].tolist()
    assert eng.pool.num_free == eng.pool.num_blocks


def test_tiny_pool_preempts_and_still_finishes_exactly(tiny_model_dir):
    big = make_engine(tiny_model_dir)
    # A pool of 10 blocks (40 tokens) for 4 requests of 10 + 6 tokens forces recompute preemptions.
    small = make_engine(tiny_model_dir, kv_cache_bytes=10 * big.runner.cache.shape.bytes_per_block,
                        preemption=PreemptionConfig(min_exec_s=0))
    prompts = [[5 + i] * 10 for i in range(4)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False)
    assert small.generate(prompts, params) == big.generate(prompts, params)
    assert sum(r.num_preempted for r in small.telemetry.recent()) > 0
    assert small.pool.num_free == small.pool.num_blocks


def test_chat_stop_strings_and_text(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    ids = encode_chat(eng.tokenizer, [{"role": "user", "content": "the capital of france"}])
    free_run = eng.generate([ids], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    text = eng.tokenizer.decode(free_run, skip_special_tokens=True)
    assert len(text) > 6
    stop = text[3:6]
    eng.add_request("s", ids, SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))
    outs = run_all(eng)["s"]
    streamed = "".join(o.new_text for o in outs)
    assert outs[-1].finish_reason is FinishReason.STOP
    assert streamed == text[: text.find(stop)] and stop not in streamed
    assert eng.pool.num_free == eng.pool.num_blocks


def test_eos_and_stop_token_ids(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    first = eng.generate([[40, 41, 42]], SamplingParams(max_tokens=5, ignore_eos=True, detokenize=False))[0]
    k = max((i for i, t in enumerate(first) if t not in first[:i]), default=0)
    eng.add_request("a", [40, 41, 42], SamplingParams(max_tokens=5, stop_token_ids=[first[k]], detokenize=False))
    outs = run_all(eng)["a"]
    assert [t for o in outs for t in o.new_token_ids] == first[: k + 1]  # the stop token is included
    assert outs[-1].finish_reason is FinishReason.STOP
    eng.add_request("b", [40, 41, 42], SamplingParams(max_tokens=5, detokenize=False))
    assert run_all(eng)["b"][-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    p = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=42, ignore_eos=True, detokenize=False)
    alone = eng.generate([[30, 31, 32]], p)[0]
    crowd = eng.generate([[30, 31, 32], [60] * 20, [7, 8]], p)[0]
    assert alone == crowd
    other = eng.generate([[30, 31, 32]], SamplingParams(**{**vars(p), "seed": 43}))[0]
    assert other != alone


def test_abort_frees_blocks_at_once(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    eng.add_request("x", [9] * 30, SamplingParams(max_tokens=50, ignore_eos=True, detokenize=False))
    eng.step()
    assert eng.pool.num_used > 0
    assert eng.abort("x") and eng.pool.num_used == 0 and not eng.has_unfinished()
    assert not eng.abort("x")


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], SamplingParams(), "empty"),
        ([5] * 500, SamplingParams(max_tokens=20), "exceeds the context length 512"),
        ([5], SamplingParams(max_tokens=0), "max_tokens"),
        ([5], SamplingParams(temperature=-1), "temperature"),
        ([5], SamplingParams(top_p=0), "top_p"),
        ([999999], SamplingParams(), "token ids"),
    ],
)
def test_bad_requests_are_refused_clearly(tiny_model_dir, prompt, params, match):
    eng = make_engine(tiny_model_dir)
    with pytest.raises(UserError, match=match):
        eng.add_request("bad", prompt, params)
    assert not eng.has_unfinished() and eng.pool.num_used == 0


def test_kv_budget_too_small_is_a_user_error(tiny_model_dir):
    with pytest.raises(UserError, match="device_memory_bytes"):
        make_engine(tiny_model_dir, kv_cache_bytes=None, device_memory_bytes=1000)


def test_telemetry_records_every_step(tiny_model_dir):
    eng = make_engine(tiny_model_dir, telemetry_ring_size=5)
    eng.generate([[5] * 9, [6] * 3], SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False))
    recs = eng.telemetry.recent()
    assert len(recs) == 5 and eng.telemetry.num_steps >= 8  # bounded ring
    last = recs[-1]
    assert last.model == "tiny" and last.wall_s >= last.forward_s > 0 and last.decision_s > 0
    assert last.kv_blocks_total == eng.pool.num_blocks

"""The CPU runner writes every forward's logits into one buffer (linear.py OutputBuffer): no new 9 MB
tensor (and its page faults) a step, the same values as a new tensor, and no consumer in the engine
(sampling, logprobs, prompt logprobs, overlap, a suspended forward) reads a step's logits after the
next forward has run, when the buffer holds the next step's."""

from __future__ import annotations

import pytest
import torch

from gpuservd.engine import overlap
from gpuservd.engine.request import SamplingParams
from gpuservd.runner.batch import SeqChunk
from gpuservd.runner.linear import Linear, OutputBuffer
from test_overlap import drive, overlapped
from test_preemption import PARAMS, engine, prompts


def test_output_buffer_grows_in_steps_and_gives_nothing_past_its_limit():
    buf = OutputBuffer(100, max_bytes=100 * 4 * 40)
    a = buf.rows(3)
    assert a.shape == (3, 100) and a.is_contiguous()
    assert buf.rows(16).data_ptr() == a.data_ptr()  # 16 rows came with the first 3
    b = buf.rows(17)
    assert b.data_ptr() != a.data_ptr() and buf.rows(32).data_ptr() == b.data_ptr()
    assert buf.rows(40).shape == (40, 100)  # grown to its limit, not past it
    assert buf.rows(41) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_heads_kernels_write_into_the_buffer_exactly(ops, dtype):
    w = torch.randn(70, 48).to(dtype)
    head = Linear(w, None)
    if head.packed is None:
        pytest.skip(f"{dtype} weights are not packed on this CPU")
    buf = OutputBuffer(70)
    for rows in (1, 5, 33, 5):
        x = torch.randn(rows, 48).to(dtype)
        want = head.fp32(x)
        got = head.fp32(x, buf)
        assert got.data_ptr() == buf.rows(rows).data_ptr() and torch.equal(got, want)


def test_runner_logits_land_in_one_buffer_with_the_values_of_new_tensors(tiny_model_dir, ops):
    eng = engine(tiny_model_dir)
    runner = eng.runner
    assert runner.model.logits_out is not None
    ps = prompts(3)
    blocks = [eng.pool.allocate(-(-len(p) // 4) + 1) for p in ps]
    chunks = [SeqChunk(p, 0, b, True) for p, b in zip(ps, blocks)]
    first = runner.execute(chunks)
    first_ptr, first_values = first.data_ptr(), first.clone()
    decode = [SeqChunk([7], len(p), b, True) for p, b in zip(ps, blocks)]
    second = runner.execute(decode)
    assert second.data_ptr() == first_ptr  # the same memory, overwritten
    runner.model.logits_out = None  # new tensors: the reference
    for p, b in zip(ps, blocks):
        eng.pool.free(b)
    blocks = [eng.pool.allocate(-(-len(p) // 4) + 1) for p in ps]
    assert torch.equal(runner.execute([SeqChunk(p, 0, b, True) for p, b in zip(ps, blocks)]), first_values)
    assert torch.equal(runner.execute([SeqChunk([7], len(p), b, True) for p, b in zip(ps, blocks)]), second)


def _poison_held_logits(eng):
    """Before each LM head call, fill the logits the previous one returned with NaN: what a consumer that
    still held them would read once the next forward has written its own."""
    model = eng.runner.model
    real = model.logits
    held: list[torch.Tensor] = []

    def logits(h, batch):
        for t in held:
            t.fill_(float("nan"))
        held.clear()
        out = real(h, batch)
        held.append(out)
        return out

    model.logits = logits


MIX = [dict(max_tokens=16), dict(max_tokens=7, temperature=0.9, top_p=0.9, seed=5, logprobs=3),
       dict(max_tokens=8, logprobs=2, prompt_logprobs=2), dict(max_tokens=6, temperature=1.1, top_k=30, seed=6),
       dict(max_tokens=12, seed=1)]


def _outputs(eng, ps):
    params = [SamplingParams(**PARAMS, **kw) for kw in MIX]
    got = {}
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(f"r{i}", p, sp)
    while eng.has_unfinished():
        for o in eng.step():
            rec = got.setdefault(o.request_id, {"ids": [], "lp": [], "prompt": None})
            rec["ids"] += o.new_token_ids
            rec["lp"] += o.logprobs or []
            if o.prompt_logprobs is not None:
                rec["prompt"] = o.prompt_logprobs
    return got


@pytest.mark.parametrize("path", ["steps", "overlap", "layer_suspend"])
def test_no_consumer_reads_a_steps_logits_after_the_next_forward(tiny_model_dir, ops, path, monkeypatch):
    def make():
        if path == "layer_suspend":
            eng = engine(tiny_model_dir, mode="on", granularity="layer", scheduler=dict(max_prefill_tokens=24))
            flip = iter([True, False] * 50)
            eng.interrupt = lambda prio: next(flip, False)  # every other prefill forward stops after a layer
            return eng
        eng = engine(tiny_model_dir)
        return overlapped(eng) if path == "overlap" else eng

    ps = prompts(len(MIX))
    want = _outputs(make(), ps)
    eng = make()
    _poison_held_logits(eng)
    launches, suspends = [], []
    real_launch, real_step = overlap.launch, eng.step
    monkeypatch.setattr(overlap, "launch", lambda *a: launches.append(1) or real_launch(*a))

    def step():
        out = real_step()
        suspends.append(eng._suspended is not None)
        return out

    eng.step = step
    assert _outputs(eng, ps) == want
    # The paths under test were taken: steps chained before the last was read, forwards suspended.
    assert (len(launches) >= 3) == (path == "overlap") and (sum(suspends) >= 2) == (path == "layer_suspend")
    assert all(len(r["ids"]) == MIX[int(k[1:])]["max_tokens"] for k, r in want.items())
    assert want["r1"]["lp"] and want["r2"]["prompt"]

"""The device sampler (runner/device_sampling.py) on the CPU: the host sampler's tokens row for row,
whatever the batch, its padding or the rows' order; stop ids checked as a tensor op; and through the
engine's fixed-shape decode step (eagerly, and through a stand-in for graph capture), the tokens of
the default path with the choice made in the step and one copy of ids per step."""

from __future__ import annotations

import pytest
import torch

from gpuservd.engine import sampler as host_sampler
from gpuservd.engine.request import Request, SamplingParams
from gpuservd.runner import device_sampling
from gpuservd.runner.batch import SeqChunk
from gpuservd.runner.device_sampling import RowSampling, choose, stop_hits
from factories import run_requests
from test_decode_step import _with_step, rerun_record
from test_preemption import engine, prompts

# (temperature, top_k, top_p, min_p): greedy, each truncation alone, and their mixes
PARAMS = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.0), (1.0, 0, 0.9, 0.0),
          (0.8, 40, 0.7, 0.0), (1.0, 0, 1.0, 0.05), (2.0, 3, 0.5, 0.1), (0.0, 7, 0.3, 0.0), (1.0, 1, 1.0, 0.0),
          (1.0, 0, 0.05, 0.0), (5.0, 0, 0.99, 0.0)]


def host_req(p, seed, step) -> Request:
    t, k, top_p, min_p = p
    r = Request(f"r{seed}-{step}", [1, 2], SamplingParams(temperature=t, top_k=k, top_p=top_p, min_p=min_p))
    r.sample_seed = seed
    r.output_token_ids = [5] * step
    return r


def device_choose(x: torch.Tensor, rows: list[tuple]) -> list[int]:
    """choose() over logits x [R, V] with rows of (params, seed, step)."""
    t = torch.tensor([p[0] for p, _, _ in rows], dtype=torch.float32)
    k = torch.tensor([p[1] for p, _, _ in rows], dtype=torch.long)
    top_p = torch.tensor([p[2] for p, _, _ in rows], dtype=torch.float32)
    min_p = torch.tensor([p[3] for p, _, _ in rows], dtype=torch.float32)
    seeds = torch.tensor([s & 0x7FFFFFFFFFFFFFFF for _, s, _ in rows], dtype=torch.long)
    steps = torch.tensor([n for _, _, n in rows], dtype=torch.long)
    return choose(x, t, k, top_p, min_p, seeds, steps).tolist()


@pytest.mark.parametrize("vocab", [64, 300, 1000])
def test_device_choice_equals_the_host_sampler_row_for_row(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows = [(p, seed, step) for p in PARAMS for seed, step in ((7, 0), (2**63 + 11, 3), (123456789, 40))]
    x = torch.randn(len(rows), vocab, generator=g) * 3
    want = host_sampler.sample(x, [host_req(*r) for r in rows]).token_ids
    assert device_choose(x, rows) == want
    # Drawn rows really draw: across seeds a sampled row's choices differ from the argmax somewhere.
    drawn = [i for i, (p, _, _) in enumerate(rows) if p[0] and p[1] != 1]
    assert any(want[i] != int(x[i].argmax()) for i in drawn)


def test_a_row_gets_its_token_whatever_the_batch():
    """A row's token depends on its own logits, parameters, seed and counter only: alone, among other
    rows, reversed, or beside padding rows (greedy, logits of a token 0) it is the same."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 500, generator=g) * 2
    rows = [(PARAMS[i % len(PARAMS)], 1000 + i, i) for i in range(8)]
    batch = device_choose(x, rows)
    assert [device_choose(x[i:i + 1], [rows[i]])[0] for i in range(8)] == batch
    assert device_choose(x.flip(0), rows[::-1]) == batch[::-1]
    pad = ((0.0, 0, 1.0, 0.0), 0, 0)
    padded = torch.cat([x, torch.randn(8, 500, generator=g)])
    assert device_choose(padded, rows + [pad] * 8)[:8] == batch


def test_stop_ids_are_a_tensor_op():
    ids = torch.tensor([5, 9, 2, 0])
    stops = torch.tensor([[5, -1, -1], [1, 2, 3], [-1, -1, 2], [-1, -1, -1]])
    assert stop_hits(ids, stops).tolist() == [1, 0, 1, 0]


def test_the_shared_hash_and_inverse_cdf_are_the_host_samplers():
    """One definition of the draw: the host sampler imports it, so both pick the same tokens."""
    assert host_sampler.uniform is device_sampling.uniform
    assert host_sampler.inverse_cdf is device_sampling.inverse_cdf


SAMPLED = dict(ignore_eos=True, detokenize=False)


def _requests():
    """Greedy and sampling requests with seeds: plain rows the device chooses."""
    return [SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=11, **SAMPLED),
            SamplingParams(max_tokens=7, **SAMPLED),
            SamplingParams(max_tokens=8, temperature=1.2, top_k=20, seed=12, **SAMPLED),
            SamplingParams(max_tokens=6, temperature=1.0, min_p=0.02, seed=13, **SAMPLED),
            SamplingParams(max_tokens=9, temperature=0.5, seed=14, **SAMPLED)]




def _count_host_samples(eng, monkeypatch) -> list:
    """The rows the host sampler was asked for, per call (the engine's RowFailures front)."""
    calls = []
    real = eng.rows.sample

    def counted(logits, requests, *a, **kw):
        calls.append(len(requests))
        return real(logits, requests, *a, **kw)

    monkeypatch.setattr(eng.rows, "sample", counted)
    return calls


@pytest.mark.parametrize("graphs", [False, True])
def test_engine_samples_in_the_decode_step_with_the_default_paths_tokens(tiny_model_dir, ops, monkeypatch, graphs):
    """Sampling requests with seeds through the fixed-shape step (padded buckets, rows finishing one by
    one): the tokens the default path's host sampler gives, with no decode step asking the host sampler."""
    from gpuservd.runner.cuda_graphs import DecodeGraphs

    ps = prompts(n=5, length=5)
    want = run_requests(engine(tiny_model_dir), ps, _requests())
    eng = _with_step(tiny_model_dir, [1, 2, 4, 8])
    step = eng.runner.decode_step
    if graphs:
        step.graphs = DecodeGraphs(step, record=rerun_record)
        eng.runner.capture_graphs()
    calls = _count_host_samples(eng, monkeypatch)
    results = []
    real_run = step.run
    monkeypatch.setattr(step, "run", lambda *a, **kw: results.append(real_run(*a, **kw)) or results[-1])
    assert run_requests(eng, ps, _requests()) == want
    assert results and all(r.sampled for r in results)  # every decode step drew on the device
    decode_steps = sum(1 for r in eng.telemetry.recent() if r.num_decode_tokens and not r.num_prefill_tokens)
    assert len(results) == decode_steps and len(calls) == len(eng.telemetry.recent()) - decode_steps
    assert step.last_path == ("graph" if graphs else "eager")


def test_one_row_the_device_cannot_sample_sends_the_step_to_the_host(tiny_model_dir, ops, monkeypatch):
    """A penalized request beside device rows: that step samples every row on the host (no draw twice),
    and the tokens stay the default path's."""
    ps = prompts(n=3, length=5)
    params = _requests()[:2] + [SamplingParams(max_tokens=5, temperature=1.0, presence_penalty=0.5, seed=3,
                                               **SAMPLED)]
    want = run_requests(engine(tiny_model_dir), ps, params)
    eng = _with_step(tiny_model_dir, [4])
    step = eng.runner.decode_step
    results = []
    real_run = step.run
    monkeypatch.setattr(step, "run", lambda *a, **kw: results.append(real_run(*a, **kw)) or results[-1])
    assert run_requests(eng, ps, params) == want
    assert results and not results[0].sampled  # the penalized row's steps: greedy in the step, drawn on the host
    assert any(r.sampled for r in results)  # once it finished, the rest drew on the device


def test_decode_result_is_one_copy_of_ids_and_verdicts(tiny_model_dir, ops):
    eng = _with_step(tiny_model_dir, [4])
    chunks = [SeqChunk([5], 9, [3, 1, 7], True, (4,), sampling=RowSampling(1.0, 0, 0.9, 0.0, 77, 2)),
              SeqChunk([6], 2, [0], True, (1,))]
    out = eng.runner.execute(chunks)
    assert out.sampled and out.host_copy.shape == (2, 2) and out.host_copy.dtype == torch.long
    ids, stops = out.host()
    assert ids == out.chosen[0].tolist() and stops == [ids[0] == 4, ids[1] == 1]
    assert ids[1] == int(out.logits[1].argmax())  # the greedy row
    r = host_req((1.0, 0, 0.9, 0.0), 77, 2)
    assert ids[0] == host_sampler.sample(out.logits[:1], [r]).token_ids[0]


def test_cpu_uniform_is_the_tensor_hash_bit_for_bit():
    """On the CPU uniform() hashes the rows as Python ints; every number equals the tensor arithmetic's
    (the device's) exactly, over seeds at the edges of 63 bits and steps past 32 bits."""
    from gpuservd.runner.device_sampling import uniform, uniform_tensor

    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.tensor([0, 1, 0x7FFFFFFFFFFFFFFF, 0xFFFFFFFF, 1 << 32, 12345]),
                       torch.randint(0, 2**63 - 1, (200,), generator=g)])
    steps = torch.cat([torch.tensor([0, 1, 2**31, 2**32 + 7, 4095, 10**12]), torch.randint(0, 1 << 20, (200,), generator=g)])
    got, want = uniform(seeds, steps), uniform_tensor(seeds, steps)
    assert got.dtype == want.dtype == torch.float64 and got.shape == want.shape
    assert torch.equal(got, want)
    assert bool(((got > 0) & (got < 1)).all())
    assert uniform(seeds[:0], steps[:0]).shape == (0,)

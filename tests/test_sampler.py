"""The batched sampler on hand-built logits: each feature, its reference formula, seeds and batches."""

from __future__ import annotations

import math

import pytest
import torch

from gpuservd.engine.request import GuidedSpec, Request, SamplingParams
from gpuservd.engine.sampler import sample, uniform
from gpuservd.errors import FieldError

V = 64
EOS = 2


def req(prompt=(5, 6), out=(), seed=0, **params) -> Request:
    r = Request(f"r{id(params)}", list(prompt), SamplingParams(**params))
    r.output_token_ids = list(out)
    r.sample_seed = seed
    return r


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_plain_greedy_is_the_argmax_and_mixed_rows_keep_it():
    x = logits(4)
    reqs = [req() for _ in range(4)]
    assert sample(x, reqs).token_ids == torch.argmax(x, -1).tolist()
    mixed = [req(), req(temperature=1.0, seed=3), req(), req(presence_penalty=1.0)]
    out = sample(x, mixed).token_ids
    assert out[0] == int(x[0].argmax()) and out[2] == int(x[2].argmax())


def test_logit_bias_moves_the_choice():
    x = logits(1)
    low = int(x[0].argmin())
    assert sample(x, [req(logit_bias={low: 100.0})]).token_ids == [low]
    top = int(x[0].argmax())
    assert sample(x, [req(logit_bias={top: -100.0})]).token_ids != [top]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    x = torch.zeros(1, V)
    x[0, EOS] = 10.0
    x[0, 9] = 9.0
    x[0, 7] = 8.0
    r = req(min_tokens=2, stop_token_ids=[9], max_tokens=5)
    assert sample(x, [r], eos_token_ids={EOS}).token_ids == [7]
    r.output_token_ids = [7, 7]  # min_tokens reached: EOS may come
    assert sample(x, [r], eos_token_ids={EOS}).token_ids == [EOS]


def reference_penalties(row, prompt, out, rep, freq, pres):
    """The formulas as vLLM (repetition) and OpenAI (frequency, presence) write them, one token at a time."""
    row = row.clone()
    for t in range(V):
        if t in prompt or t in out:
            row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
        c = out.count(t)
        row[t] -= c * freq + (1 if c else 0) * pres
    return row


@pytest.mark.parametrize("rep,freq,pres", [(1.3, 0.0, 0.0), (1.0, 0.7, 0.0), (1.0, 0.0, 1.5), (0.8, -0.5, 0.4)])
def test_penalties_match_the_reference_formula(rep, freq, pres):
    x = logits(2, seed=1)
    prompt, out = [1, 3, 3, 10], [10, 11, 11, 11, 40]
    r = req(prompt=prompt, out=out, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
            logprobs=V)
    other = req(prompt=[50], out=[51])  # a plain row in the same batch is left alone
    res = sample(x, [r, other])
    want = torch.log_softmax(reference_penalties(x[0], prompt, out, rep, freq, pres), -1)
    got = torch.full((V,), float("nan"))
    for tok, lp in res.logprobs[0].top:
        got[tok] = lp
    assert torch.allclose(got, want, atol=1e-5)
    assert res.token_ids[0] == int(want.argmax()) and res.token_ids[1] == int(x[1].argmax())


def test_logprobs_are_of_the_distribution_sampled_from():
    x = logits(1, seed=2)
    r = req(temperature=0.5, top_k=5, logprobs=8, seed=11)
    res = sample(x, [r])
    lp = res.logprobs[0]
    scaled = x[0] / 0.5
    keep = torch.topk(scaled, 5).indices
    want = torch.full((V,), float("-inf"))
    want[keep] = torch.log_softmax(scaled[keep], -1)
    assert lp.token_id == res.token_ids[0] and lp.token_id in keep.tolist()
    assert lp.logprob == pytest.approx(float(want[lp.token_id]), abs=1e-5)
    assert [t for t, _ in lp.top[:5]] == keep.tolist()
    assert all(v == float("-inf") for _, v in lp.top[5:])  # outside top_k: probability 0
    assert math.isclose(sum(math.exp(v) for _, v in lp.top), 1.0, rel_tol=1e-5)
    # Greedy rows report the processed logits at temperature 1.
    g = sample(x, [req(logprobs=0)]).logprobs[0]
    assert g.top == [] and g.logprob == pytest.approx(float(torch.log_softmax(x[0], -1).max()), abs=1e-6)


def test_top_p_and_min_p_truncate():
    x = torch.full((1, V), -10.0)
    x[0, :4] = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    seen_p, seen_minp = set(), set()
    for s in range(200):
        seen_p.add(sample(x, [req(temperature=1.0, top_p=0.7, seed=s)]).token_ids[0])
        seen_minp.add(sample(x, [req(temperature=1.0, min_p=0.2, seed=s)]).token_ids[0])
    assert seen_p == {0, 1}  # 0.5 + 0.3 reaches 0.7
    assert seen_minp == {0, 1, 2}  # 0.15 >= 0.2 * 0.5 but 0.05 is not


def test_top_p_on_a_flat_distribution_sorts_the_whole_vocabulary(monkeypatch):
    monkeypatch.setattr("gpuservd.engine.sampler.NUCLEUS_CANDIDATES", 4)
    x = -0.01 * torch.arange(V, dtype=torch.float32).unsqueeze(0)  # nearly flat, decreasing
    probs = torch.softmax(x[0], -1)
    nucleus = int(((probs.cumsum(0) - probs) < 0.5).sum())  # far more than the 4 candidates
    seen = {sample(x, [req(temperature=1.0, top_p=0.5, seed=s)]).token_ids[0] for s in range(300)}
    assert nucleus > 20 and len(seen) > 20 and seen <= set(range(nucleus))


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    x = torch.full((1, V), float("-inf"))
    x[0, :4] = probs.log()
    n = 4000
    counts = torch.zeros(4)
    for s in range(n):
        counts[sample(x, [req(temperature=1.0, seed=s)]).token_ids[0]] += 1
    chi2 = float((((counts - n * probs) ** 2) / (n * probs)).sum())
    assert chi2 < 16.3  # p = 0.001 for 3 degrees of freedom; the seeds are fixed, so this never flakes


def test_uniform_is_a_function_of_seed_and_step_only():
    seeds = torch.tensor([1, 2, 1, 2**62 + 5])
    steps = torch.tensor([0, 0, 1, 0])
    u = uniform(seeds, steps)
    assert torch.equal(u, uniform(seeds, steps)) and bool(((u > 0) & (u < 1)).all())
    assert len(set(u.tolist())) == 4
    assert uniform(seeds[2:3], steps[2:3]).item() == u[2].item()
    many = uniform(torch.arange(20000), torch.zeros(20000, dtype=torch.long))
    assert abs(float(many.mean()) - 0.5) < 0.01 and abs(float(many.var()) - 1 / 12) < 0.005


def test_seeded_rows_do_not_depend_on_the_batch():
    x = logits(6, seed=4)
    mine = req(temperature=1.0, top_p=0.95, seed=1234, out=[3, 4])
    alone = sample(x[2:3], [mine]).token_ids[0]
    others = [req(), req(temperature=0.7, seed=9), req(frequency_penalty=1.0, logprobs=3), req(top_k=3,
              temperature=2.0, seed=5), req(min_p=0.1, temperature=1.0, seed=6)]
    batch = others[:2] + [mine] + others[2:]
    for order in (batch, list(reversed(batch))):
        rows = torch.stack([x[2] if r is mine else x[batch.index(r)] for r in order])
        assert sample(rows, order).token_ids[order.index(mine)] == alone


def test_bitmask_limits_only_its_rows():
    x = logits(3, seed=5)
    words = (V + 31) // 32
    bitmask = torch.full((3, words), -1, dtype=torch.int32)
    bitmask[1] = 0
    bitmask[1, 1] = 1 << 3  # only token 35
    r = [req(), req(guided=GuidedSpec("regex", "x", "guided_regex")), req(temperature=1.0, seed=2)]
    res = sample(x, r, bitmask=bitmask, masked=[False, True, False])
    assert res.token_ids[1] == 35
    assert res.token_ids[0] == int(x[0].argmax())
    assert res.token_ids[2] == sample(x[2:3], [r[2]]).token_ids[0]


@pytest.mark.parametrize("params,field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={5: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(top_k=-1), "top_k"), (dict(seed=1.5), "seed"),
])
def test_validation_names_the_field(params, field):
    with pytest.raises(FieldError, match=field) as exc:
        SamplingParams(**params).validate()
    assert exc.value.param == field


def test_vocabulary_checks_name_the_field():
    with pytest.raises(FieldError, match=r"logit_bias.*\[0, 64\)"):
        SamplingParams(logit_bias={64: 1.0}).check_vocab(V)
    SamplingParams(logit_bias={63: 1.0}).check_vocab(V)


def test_two_level_draw_is_the_inverse_cdf_over_the_whole_vocabulary():
    # A vocabulary that is not a multiple of the chunk, and a mask that leaves some chunks empty.
    vocab = 1000
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(7)) * 2
    words = (vocab + 31) // 32
    bitmask = torch.full((3, words), -1, dtype=torch.int32)
    bitmask[1, :20] = 0  # row 1: no token below 640
    rows = [req(temperature=0.8, seed=s, out=[1] * s) for s in range(3)]
    for trial in range(60):
        for r in rows:
            r.sample_seed = 1000 + trial
        got = sample(x, rows, bitmask=bitmask, masked=[False, True, False]).token_ids
        for i, r in enumerate(rows):
            row = x[i].clone()
            if i == 1:
                row[:640] = float("-inf")
            p = torch.softmax(row.double() / 0.8, -1)
            cdf = torch.cumsum(p, -1)
            u = uniform(torch.tensor([r.sample_seed]), torch.tensor([len(r.output_token_ids)]))
            assert got[i] == int(torch.searchsorted(cdf, u * cdf[-1], right=True)), (trial, i)
        assert got[1] >= 640


def test_logprobs_only_for_the_rows_that_ask_and_the_draw_does_not_depend_on_them():
    x = logits(3, seed=8)
    asks = [req(temperature=0.9, seed=4, logprobs=2), req(temperature=0.9, seed=5), req(temperature=0.9, seed=6)]
    silent = [req(temperature=0.9, seed=4), req(temperature=0.9, seed=5), req(temperature=0.9, seed=6, logprobs=0)]
    a, b = sample(x, asks), sample(x, silent)
    assert a.token_ids == b.token_ids
    assert a.logprobs[1] is None and a.logprobs[2] is None and b.logprobs[0] is None
    want = torch.log_softmax(x[0] / 0.9, -1)
    assert a.logprobs[0].logprob == pytest.approx(float(want[a.token_ids[0]]), abs=1e-5)
    assert [t for t, _ in a.logprobs[0].top] == torch.topk(want, 2).indices.tolist()
    assert b.logprobs[2].top == [] and b.logprobs[2].token_id == b.token_ids[2]


def test_a_row_without_truncation_keeps_its_vocabulary_beside_rows_with_it():
    """Truncation is per row: a temperature-only row beside a top_k or a top_p row draws from its whole
    distribution, as it does alone (its logprobs, those of the distribution drawn from, show it)."""
    x = logits(2, seed=8)
    mine = req(temperature=1.0, seed=3, logprobs=5)
    alone = sample(x[:1], [mine]).logprobs[0]
    assert all(math.isfinite(v) for _, v in alone.top)
    for other in (req(temperature=1.0, top_k=2, seed=4), req(temperature=1.0, top_p=0.5, seed=4)):
        assert sample(x, [mine, other]).logprobs[0] == alone
    # A peaked row whose float32 running sum reaches 1.0 before its tail: beside a top_p row the tail stays.
    peaked = torch.zeros(2, V)
    peaked[:, 0] = 30.0
    alone = sample(peaked[:1], [mine]).logprobs[0]
    assert sample(peaked, [mine, req(temperature=1.0, top_p=0.9, seed=4)]).logprobs[0] == alone
    assert all(math.isfinite(v) for _, v in alone.top)

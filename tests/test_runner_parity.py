"""The runner's logits match transformers' own models on the same weights."""

from __future__ import annotations

import pytest
import torch

from factories import make_hf_model
from gpuservd.kv_cache.cache import KVCache, cache_shape
from gpuservd.runner.batch import SeqChunk, build_batch, group_decodes
from gpuservd.runner.llama import LlamaModel
from gpuservd.runner.model_config import load_arch
from gpuservd.runner.load import load_weights
from gpuservd.runner.model_runner import DTYPES

CASES = {
    "llama": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3-rope": dict(
        arch="llama",
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "linear-rope": dict(arch="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}),
    "mistral": dict(arch="mistral", sliding_window=None),
    "qwen2-bias": dict(arch="qwen2"),
    "mha": dict(arch="llama", num_key_value_heads=4),
}


def _load(path, dtype="float32", block_size=4, num_blocks=64):
    arch = load_arch(path)
    dt = DTYPES[dtype]
    weights = load_weights(path, arch, dt, torch.device("cpu"))
    model = LlamaModel(arch, weights, 512, dt, "cpu")
    cache = KVCache(cache_shape(arch, block_size, dt), num_blocks, torch.device("cpu"))
    return model, cache


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunked_prefill_and_decode_match_transformers(tmp_path, case):
    kw = dict(CASES[case])
    hf = make_hf_model(tmp_path, kw.pop("arch"), **kw)
    model, cache = _load(tmp_path)
    ids = torch.randint(3, 300, (1, 27), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [27, V]
    blocks = cache.pool.allocate(7)
    # Prefill in uneven chunks, then decode one token at a time.
    for start, end in [(0, 5), (5, 13), (13, 24), (24, 25), (25, 26), (26, 27)]:
        batch = build_batch([SeqChunk(ids[0, start:end].tolist(), start, blocks, True)], 4, torch.device("cpu"))
        got = model.forward(batch, cache.layer)[0]
        torch.testing.assert_close(got, ref[end - 1], atol=2e-5, rtol=1e-4)


def test_mixed_batch_of_many_sequences_matches_each_alone(tmp_path):
    """Decode tokens of different lengths and prefill chunks in one flat batch."""
    hf = make_hf_model(tmp_path, "llama")
    model, cache = _load(tmp_path, num_blocks=128)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (n,), generator=g) for n in (3, 40, 9, 17, 70)]
    with torch.no_grad():
        refs = [hf(p[None]).logits[0] for p in prompts]
    tables = [cache.pool.allocate(-(-len(p) // 4)) for p in prompts]
    # Sequences 0-2 have all but their last token cached; 3 and 4 prefill in one chunk each.
    pre = [SeqChunk(p[:-1].tolist(), 0, t, False) for p, t in zip(prompts[:3], tables)]
    model.forward(build_batch(pre, 4, torch.device("cpu")), cache.layer)
    chunks = [SeqChunk([int(p[-1])], len(p) - 1, t, True) for p, t in zip(prompts[:3], tables)]
    chunks.insert(1, SeqChunk(prompts[3].tolist(), 0, tables[3], True))
    chunks.append(SeqChunk(prompts[4].tolist(), 0, tables[4], True))
    logits = model.forward(build_batch(chunks, 4, torch.device("cpu")), cache.layer)
    expect = [refs[0][-1], refs[3][-1], refs[1][-1], refs[2][-1], refs[4][-1]]
    for got, want in zip(logits, expect):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype,tol", [("bfloat16", 0.08), ("float16", 0.02)])
def test_low_precision_within_dtype_tolerance(tmp_path, dtype, tol):
    hf = make_hf_model(tmp_path, "llama")
    model, cache = _load(tmp_path, dtype=dtype)
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.to(DTYPES[dtype])(ids).logits[0].float()
    blocks = cache.pool.allocate(5)
    got = model.forward(build_batch([SeqChunk(ids[0].tolist(), 0, blocks, True)], 4, torch.device("cpu")), cache.layer)
    assert (got[0] - ref[-1]).abs().max().item() < tol * max(1.0, ref[-1].abs().max().item())


def test_decode_groups_bound_padding():
    """A single long context does not pad every short sequence up to its length."""
    from gpuservd.runner.batch import MAX_PAD_WASTE, PAD_SLACK_TOKENS

    groups = group_decodes([2000] + [100] * 31)
    assert [len(g) for g in groups] == [1, 31]  # 2000 vs 100 tokens: far past the padding bound
    assert len(group_decodes([100, 90, 120, 130])) == 1  # close lengths share one group
    lens = [5, 500, 70, 900, 33, 1000, 64, 2500, 1800]
    for g in group_decodes(lens):
        longest, real = max(lens[i] for i in g), sum(lens[i] for i in g)
        close = longest - min(lens[i] for i in g) <= PAD_SLACK_TOKENS
        assert close or longest * len(g) <= (1 + MAX_PAD_WASTE) * real


def test_refuses_unsupported_architecture(tmp_path):
    import json

    from gpuservd.errors import UserError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError, match="LlamaForCausalLM"):
        load_arch(tmp_path)


def test_onednn_linear_pads_long_row_counts_exactly():
    from gpuservd.runner.linear import Linear, onednn_available

    if not onednn_available(torch.device("cpu"), torch.float32):
        pytest.skip("torch built without oneDNN")
    w, b = torch.randn(48, 32), torch.randn(48)
    lin = Linear(w.clone(), b, use_onednn=True, use_packed=False)  # the dense layout
    for rows in (1, 7, 64, 65, 100, 128):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_decode_groups_are_built_only_when_read(monkeypatch):
    """The kernels never read a batch's decode groups, so build_batch leaves them to the first reader (the
    torch attention path), which gets what building them at once gave."""
    from gpuservd.runner import batch as batch_mod

    built = []
    real = batch_mod._decode_groups
    monkeypatch.setattr(batch_mod, "_decode_groups", lambda *a: built.append(1) or real(*a))
    chunks = [SeqChunk([5], 40, [3, 1, 4], True), SeqChunk([6], 300, list(range(10, 29)), True),
              SeqChunk([7, 8], 0, [2], True)]
    batch = build_batch(chunks, 16, torch.device("cpu"))
    assert built == []
    want = real([41, 301], [[3, 1, 4], list(range(10, 29))], torch.device("cpu"))
    assert len(batch.decode_groups) == len(want) == 2 and built == [1]
    for got, exp in zip(batch.decode_groups, want):
        assert torch.equal(got.rows, exp.rows) and torch.equal(got.block_table, exp.block_table)
        assert got.max_len == exp.max_len and (got.mask is None) == (exp.mask is None)
    assert built == [1]  # built once

"""The bf16 paths of the C++ kernels agree with torch (bf16 tolerance), and SmolLM2 in bf16 with transformers.

gemv's dot-product kernel (vdpbf16ps) exists only where the CPU has AVX512_BF16: its tests skip,
saying so, elsewhere. The vectorized bf16 silu_mul / rms_norm and the prefetching paged attention
run on any AVX2 CPU (scalar loops without it) and are tested everywhere.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpuservd.runner import cpu_kernels
from gpuservd.runner.linear import GEMV_MAX_ROWS_BF16_DP, Linear


@pytest.fixture(scope="module")
def dp(ops):
    if not cpu_kernels.bf16_dp():
        pytest.skip("no AVX512_BF16 on this CPU (or the kernels were built without -mavx512bf16): "
                    "bf16 gemv takes the widening fp32-FMA kernel, tested in test_gemv.py")
    return ops


def _ref(x, w, b):
    """fp32 x @ W^T + b of the bf16 inputs: what the kernel computes before its one rounding."""
    y = F.linear(x.float(), w.float())
    return y if b is None else y + b.float()


# K % 32 tails (masked loads), K < 32, N not a multiple of the 4-row register block,
# SmolLM2's shapes, and row counts that leave partial groups of x rows.
@pytest.mark.parametrize("out_f,in_f", [(1, 1), (7, 13), (5, 31), (9, 32), (33, 70), (960, 576), (576, 1536),
                                        (130, 4099)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 32, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_dp_gemv_matches_torch(dp, out_f, in_f, rows, bias):
    g = torch.Generator().manual_seed(out_f * 1000 + in_f * 10 + rows)
    x = (torch.randn(rows, in_f, generator=g) / 4).bfloat16()
    w = (torch.randn(out_f, in_f, generator=g) / 4).bfloat16()
    b = torch.randn(out_f, generator=g).bfloat16() if bias else None
    y = dp.gemv(x, w, b)
    assert y.shape == (rows, out_f) and y.dtype == torch.bfloat16
    ref = _ref(x, w, b)
    # One bf16 rounding of an fp32-accumulated result (plus fp32 summation-order noise).
    torch.testing.assert_close(y.float(), ref, atol=1e-3 * in_f ** 0.5, rtol=8e-3)
    # ... and no further from the exact answer than the widening fp32-FMA kernel, by more than one bf16 step.
    widen = dp.gemv_widen(x, w, b).float()
    step = ref.abs().max().item() * 2 ** -7 + 1e-3
    assert (y.float() - ref).abs().max().item() <= (widen - ref).abs().max().item() + step


def test_dp_gemv_reads_a_row_strided_x(dp):
    big = torch.randn(5, 200).bfloat16()
    x, w = big[:, 7:167], torch.randn(40, 160).bfloat16()
    torch.testing.assert_close(dp.gemv(x, w, None).float(), _ref(x, w, None), atol=0.05, rtol=8e-3)


def test_linear_routes_up_to_64_bf16_rows_to_the_kernel(dp, monkeypatch):
    """The dense layout (GPUSERV_PACKED_WEIGHTS=0; packed weights take every row count, test_packed_gemm.py)."""
    w, b = torch.randn(48, 40).bfloat16(), torch.randn(48).bfloat16()
    lin = Linear(w, b, use_packed=False)
    assert lin.gemv and lin.gemv_max_rows == GEMV_MAX_ROWS_BF16_DP == 64
    assert Linear(w.float(), b.float()).gemv_max_rows == 32  # fp32 routing unchanged
    calls = []
    real = lin._gemv

    class Spy:
        def gemv(self, *a):
            calls.append(a[0].shape[0])
            return real.gemv(*a)

    monkeypatch.setattr(lin, "_gemv", Spy())
    for rows in (1, 33, 64, 65, 100):
        x = torch.randn(rows, 40).bfloat16()
        torch.testing.assert_close(lin(x).float(), _ref(x, w, b), atol=0.05, rtol=8e-3)
    assert calls == [1, 33, 64]


@pytest.mark.parametrize("rows,width", [(1, 1536), (37, 1541), (4, 5)])
def test_bf16_silu_mul_rounds_as_torch(ops, rows, width):
    gu = (torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    gu[0, 0] = float("nan")
    g, u = gu[:, :width].float(), gu[:, width:].float()
    want = (F.silu(g).bfloat16().float() * u).bfloat16()  # transformers: silu in bf16, then the product
    got = ops.silu_mul(gu)
    assert torch.isnan(got[0, 0])
    got, want = got.float().flatten()[1:], want.float().flatten()[1:]
    diff = (got - want).abs()
    # exp8 vs std::exp: at most one bf16 step where the fp32 value sits on a rounding boundary.
    assert (diff <= want.abs() * 2 ** -7).all()
    assert (diff > 0).float().mean().item() < 0.01


@pytest.mark.parametrize("rows,dim", [(1, 576), (33, 587), (3, 7)])
def test_bf16_rms_norm_and_residual_add(ops, rows, dim):
    from gpuservd.runner.llama import rms_norm

    g = torch.Generator().manual_seed(dim)
    x, w = torch.randn(rows, dim, generator=g).bfloat16(), torch.randn(dim, generator=g).bfloat16()
    want = rms_norm(x, w, 1e-5)
    got = ops.rms_norm(x, w, 1e-5)
    step = want.float().abs() * 2 ** -7
    assert ((got.float() - want.float()).abs() <= step).all()
    d = torch.randn(rows, dim, generator=g).bfloat16()
    h = x.clone()
    y = ops.add_rms_norm_(h, d, w, 1e-5)
    assert torch.equal(h, x + d)
    want = rms_norm(x + d, w, 1e-5)
    assert ((y.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()


@pytest.mark.parametrize("ctx", [1, 15, 16, 17, 80, 300])
@pytest.mark.parametrize("heads,kvh,d", [(9, 3, 64), (8, 1, 64), (8, 2, 128), (16, 2, 128), (4, 4, 32)])
def test_bf16_paged_decode_with_prefetch_matches_torch(ops, ctx, heads, kvh, d):
    """The prefetching (bf16) item walk: runs that start mid-block, one-token contexts, many blocks; the
    dot-product item (AVX512_BF16) at head_dim 64 / 128 and group sizes 1-8 (one and two V passes), and
    a head_dim it does not take (32: the AVX2 item)."""
    from gpuservd.runner.attention import decode_attention_torch
    from gpuservd.runner.batch import SeqChunk, build_batch

    bs = 16
    g = torch.Generator().manual_seed(ctx)
    nblk = -(-ctx // bs) + 1
    b = 5
    k_cache = torch.randn(b * nblk + 3, bs, kvh, d, generator=g).bfloat16()
    v_cache = torch.randn(b * nblk + 3, bs, kvh, d, generator=g).bfloat16()
    perm = torch.randperm(b * nblk + 3, generator=g).tolist()
    tables = [perm[i * nblk:(i + 1) * nblk] for i in range(b)]
    lens = [max(1, ctx - 3 * i) for i in range(b)]
    batch = build_batch([SeqChunk([1], n - 1, t, True) for n, t in zip(lens, tables)], bs, torch.device("cpu"))
    q = torch.randn(b, heads, d, generator=g).bfloat16()
    qs = torch.randn(b, 2 * heads, d, generator=g).bfloat16()[:, ::2]  # a head stride of 2 * d
    for query in (q, qs):
        got = ops.paged_decode(query, k_cache, v_cache, batch.decode_block_table, batch.decode_ctx_lens, 0.125)
        want = decode_attention_torch(query.float(), k_cache.float(), v_cache.float(), batch, 0.125)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)


@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_bf16_logits_match_transformers_bf16(smollm2_dir):
    """Prefill and decode (gemv dot products, paged attention) in bf16 against transformers in bf16."""
    from transformers import LlamaForCausalLM

    from gpuservd.config import EngineConfig
    from gpuservd.engine.engine import LLMEngine
    from gpuservd.engine.tokenizer import encode_chat
    from gpuservd.runner.batch import SeqChunk, build_batch

    torch.set_num_threads(2)
    hf = LlamaForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    eng = LLMEngine("smollm2", smollm2_dir, EngineConfig(kv_cache_bytes=64 << 20, dtype="bfloat16"))
    ids = encode_chat(eng.tokenizer, [{"role": "user", "content": "What is the capital of France?"}])
    ids = ids + [504, 3575, 282, 4649, 314]  # a few decode steps after the prompt
    n_prompt = len(ids) - 5
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()  # [L, V]
    bs = eng.config.block_size
    blocks = eng.pool.allocate(-(-len(ids) // bs))
    got = []
    try:
        batch = build_batch([SeqChunk(ids[:n_prompt], 0, blocks, True)], bs, torch.device("cpu"))
        got.append(eng.runner.model.forward(batch, eng.runner.cache.layer)[0].clone())  # the runner reuses its buffer
        for pos in range(n_prompt, len(ids)):
            batch = build_batch([SeqChunk([ids[pos]], pos, blocks, True)], bs, torch.device("cpu"))
            got.append(eng.runner.model.forward(batch, eng.runner.cache.layer)[0].clone())
    finally:
        eng.pool.free(blocks)
    for i, logits in enumerate(got):
        want = ref[n_prompt - 1 + i]
        scale = want.abs().max().item()
        assert (logits - want).abs().max().item() < 0.08 * scale, i
        assert logits.argmax().item() == want.argmax().item(), i
        assert F.cosine_similarity(logits, want, dim=0).item() > 0.999, i

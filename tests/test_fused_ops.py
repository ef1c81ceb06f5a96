"""The fused C++ layer ops agree with the torch code they replace, in every dtype; so does a whole model."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from factories import make_hf_model
from gpuservd.kv_cache.cache import KVCache, cache_shape
from gpuservd.runner.attention import write_kv
from gpuservd.runner.batch import SeqChunk, build_batch
from gpuservd.runner.llama import LlamaModel, rms_norm
from gpuservd.runner.model_config import load_arch
from gpuservd.runner.rope import apply_rope
from gpuservd.runner.load import load_weights

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32: summation order and fused multiply-adds only. bf16/fp16: one rounding step apart at most.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=1e-2),
       torch.float16: dict(atol=4e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 300])
@pytest.mark.parametrize("dim", [96, 76, 5])  # the fp32 kernel's 32-lane loop; + its 8-lane loop and tail; tail only
def test_rms_norm_and_residual_add(ops, dtype, rows, dim):
    g = torch.Generator().manual_seed(rows)
    h = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    d = torch.randn(rows, dim, generator=g).to(dtype)
    w = torch.randn(dim, generator=g).to(dtype)
    torch.testing.assert_close(ops.rms_norm(h, w, 1e-5), rms_norm(h, w, 1e-5), **TOL[dtype])
    want_h = h + d
    want = rms_norm(want_h, w, 1e-6)
    got = ops.add_rms_norm_(h, d, w, 1e-6)
    assert torch.equal(h, want_h)  # the residual stream is updated in place, rounded as torch rounds
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 200])
def test_silu_mul(ops, dtype, rows):
    gu = (torch.randn(rows, 2 * 100, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow and underflow
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store_kv(ops, dtype):
    heads, kv_heads, dim, block_size, tokens = 6, 2, 16, 4, 7
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=g) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [T, 1, dim] as RopeTables.lookup
    chunks = [SeqChunk([1, 2, 3], 2, [5, 1], True), SeqChunk([4], 9, [0, 3, 2], True), SeqChunk([5, 6, 7], 0, [4], True)]
    batch = build_batch(chunks, block_size, torch.device("cpu"))
    k_want = torch.zeros(6, block_size, kv_heads, dim, dtype=dtype)
    v_want = torch.zeros_like(k_want)
    rotated = apply_rope(qkv[:, : heads + kv_heads], cos, sin)
    write_kv(k_want, v_want, rotated[:, heads:], qkv[:, heads + kv_heads :], batch)
    k_got, v_got = torch.zeros_like(k_want), torch.zeros_like(v_want)
    got = qkv.clone()
    ops.rope_store_kv(got, cos, sin, k_got, v_got, batch.slots, heads, kv_heads)
    torch.testing.assert_close(got[:, : heads + kv_heads], rotated, **TOL[dtype])
    assert torch.equal(got[:, heads + kv_heads :], qkv[:, heads + kv_heads :])  # v untouched
    torch.testing.assert_close(k_got, k_want, **TOL[dtype])
    assert torch.equal(v_got, v_want)
    with pytest.raises(RuntimeError, match="slot out of range"):
        bad = batch.slots.clone()
        bad[0] = 6 * block_size
        ops.rope_store_kv(qkv.clone(), cos, sin, k_got, v_got, bad, heads, kv_heads)
    # Padding rows of a fixed-shape batch (slot -1) are rotated but write nowhere.
    pad = batch.slots.clone()
    pad[1::2] = -1
    k_pad, v_pad = torch.zeros_like(k_want), torch.zeros_like(v_want)
    got = qkv.clone()
    ops.rope_store_kv(got, cos, sin, k_pad, v_pad, pad, heads, kv_heads)
    torch.testing.assert_close(got[:, : heads + kv_heads], rotated, **TOL[dtype])
    kept = pad[pad >= 0]
    flat = (-1, kv_heads, dim)
    assert torch.equal(k_pad.view(flat)[kept], k_got.view(flat)[kept])
    assert torch.equal(v_pad.view(flat)[kept], v_want.view(flat)[kept])
    assert int((k_pad.view(flat).abs().sum((1, 2)) != 0).sum()) == len(kept)  # nothing else written


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_with_and_without_kernels_agree(ops, tmp_path, dtype):
    """The same chunked prefill + mixed decode batch through the fused layers and through plain torch."""
    make_hf_model(tmp_path, "qwen2")  # qkv bias, GQA
    arch = load_arch(tmp_path)
    dt = getattr(torch, dtype)
    weights = load_weights(tmp_path, arch, dt, torch.device("cpu"))
    logits = []
    for use_ops in (True, False):
        model = LlamaModel(arch, weights, 512, dt, "cpu")
        if not use_ops:
            model._ops = None
        cache = KVCache(cache_shape(arch, 4, dt), 64, torch.device("cpu"))
        g = torch.Generator().manual_seed(9)
        prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (9, 23, 4)]
        tables = [cache.pool.allocate(-(-(len(p) + 2) // 4)) for p in prompts]
        out = [model.forward(build_batch([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables)], 4,
                                         torch.device("cpu")), cache.layer)]
        for step in range(2):
            chunks = [SeqChunk([7 + step], len(p) + step, t, True) for p, t in zip(prompts, tables)]
            out.append(model.forward(build_batch(chunks, 4, torch.device("cpu")), cache.layer))
        logits.append(torch.cat(out))
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == "float32" else dict(atol=0.08, rtol=0)
    torch.testing.assert_close(logits[0], logits[1], **tol)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 100, 49152])
def test_argmax_rows_matches_torch_including_ties_and_nan(ops, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(6, n, generator=g)
    if n > 3:
        x[1, :] = 0.5  # all equal: the first index
        x[2, n // 2] = x[2, n - 1] = 99.0  # a tie: the first of the two
        x[3, n - 1] = float("nan")  # NaN in the tail (past the vector loop)
        x[4, 1] = float("nan")  # NaN in the first vector, bigger values later
        x[4, n - 2] = 1e9
        x[5] = float("-inf")
        x[5, n - 1] = -1e30
    assert ops.argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 12])  # SmolLM2's head dim (8-lane loop), and one the scalar loop takes
def test_rope_store_kv_is_apply_rope_bit_for_bit(ops, dim, dtype):
    """Rope in the kernel rounds exactly as apply_rope (x * cos + rotated * sin, no FMA; in bf16 each
    product rounded, then the sum), so the model's logits stay bit-identical to transformers' rope."""
    heads, kv_heads, tokens = 9, 3, 5
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    qkv[0, 0, :3] = torch.tensor([0.0, -0.0, float("inf")])  # signed zeros and an infinity, bit for bit too
    angles = torch.rand(tokens, dim // 2, generator=g) * 500
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    k_cache = torch.zeros(2, 4, kv_heads, dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    got = qkv.clone()
    ops.rope_store_kv(got, cos, sin, k_cache, v_cache, torch.arange(tokens), heads, kv_heads)
    want = apply_rope(qkv[:, : heads + kv_heads], cos, sin)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32  # -0.0 and 0.0 differ here
    assert torch.equal(got[:, : heads + kv_heads].contiguous().view(bits), want.contiguous().view(bits))
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[:tokens], got[:, heads : heads + kv_heads])


class _CountingOps:
    """The kernels' namespace, counting the calls of each op."""

    def __init__(self, ops):
        self._ops, self.calls = ops, {}

    def __getattr__(self, name):
        fn = getattr(self._ops, name)

        def counted(*a):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*a)
        return counted


def test_fused_forward_adds_each_residual_and_norms_the_next_layer_in_one_op(ops, tmp_path):
    """A layer's closing residual add and the next layer's input norm run as one add_rms_norm_, so a forward
    of L layers makes one rms_norm call (layer 0) and 2L - 1 add_rms_norm_ calls; a forward suspended between
    layers and resumed (which norms h again) gives the uninterrupted forward's logits bit for bit."""
    make_hf_model(tmp_path, "llama")
    arch = load_arch(tmp_path)
    weights = load_weights(tmp_path, arch, torch.float32, torch.device("cpu"))
    model = LlamaModel(arch, weights, 128, torch.float32, "cpu")
    model.stack_enabled = False  # the layer loop (the stack runs these ops from C++: test_decoder_stack.py)
    model._ops = counting = _CountingOps(ops)
    logits = []
    for suspend_at in (None, 0):
        cache = KVCache(cache_shape(arch, 4, torch.float32), 16, torch.device("cpu"))
        prompt = list(range(3, 14))
        batch = build_batch([SeqChunk(prompt, 0, cache.pool.allocate(3), True)], 4, torch.device("cpu"))
        counting.calls = {}
        if suspend_at is None:
            logits.append(model.forward(batch, cache.layer))
            assert counting.calls["rms_norm"] == 1
            assert counting.calls["add_rms_norm_"] == 2 * arch.num_layers - 1
        else:
            cp = model.forward(batch, cache.layer, suspend=lambda i: i == suspend_at)
            assert cp.next_layer == suspend_at + 1
            logits.append(model.forward(batch, cache.layer, resume=cp))
    assert arch.num_layers >= 2 and torch.equal(logits[0], logits[1])

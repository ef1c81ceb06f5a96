"""The Triton kernels (paged decode attention, add + RMSNorm, rope + KV store, SiLU x up) against
torch references: on a CUDA device where there is one, else in Triton's interpreter on the CPU
(TRITON_INTERPRET=1, set before the kernels are imported). The cases cover ragged lengths, padding
rows (length 0, slot -1), one-token and long contexts, block sizes 16 and 32 (and 4, the path below
tl.dot's tile), head_dim 64 and 128, GQA groups 1-8 and each dtype, spread over a list of cases
rather than their full product so the interpreter's runtime stays small."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    # Read when a function is decorated with triton.jit, Triton's own library included: set before
    # Triton is first imported (nothing in gpuservd imports it on a machine without CUDA).
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from gpuservd.runner import triton_attention, triton_fused  # noqa: E402
from gpuservd.runner.llama import rms_norm  # noqa: E402
from gpuservd.runner.rope import apply_rope  # noqa: E402

# The interpreter does numpy arithmetic on masked-off lanes too (-inf - -inf): harmless, not results.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
DEV = torch.device("cuda:0" if CUDA else "cpu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# Relative error ||out - ref|| / ||ref|| against a float64 reference (METHOD.md's bands).
REL = {F32: 1e-5, F16: 3e-3, BF16: 2e-2}


def assert_rounded_like(got: torch.Tensor, want: torch.Tensor):
    """Equal to torch's roundings. In the interpreter bf16 only close (relative error under one bf16
    rounding, no element off by more than a few): its fp32 -> bf16 cast truncates (Triton 3.7) where
    the GPU rounds to nearest even."""
    got = got.cpu()
    if CUDA or got.dtype != BF16:
        assert torch.equal(got, want)
    else:
        assert rel_err(got, want) < 2 ** -7
        assert ((got.float() - want.float()).abs() <= 2 ** -4 * want.float().abs().clamp_min(1)).all()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def reference_decode(q, k_cache, v_cache, table, lens, scale):
    """float64 attention of each row over its gathered context; zeros for length 0."""
    b, h, d = q.shape
    kvh = k_cache.shape[2]
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        if n == 0:
            continue
        blocks = table[i].long().cpu()
        k = k_cache.cpu().double()[blocks].flatten(0, 1)[:n]  # [n, kvh, d]
        v = v_cache.cpu().double()[blocks].flatten(0, 1)[:n]
        k, v = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].cpu().double(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
    return out


# (dtype, block_size, head_dim, kv_heads, group, context lengths (0 = padding row), partitions)
DECODE_CASES = [
    (F32, 16, 64, 2, 1, [1, 17, 0, 40], None),
    (BF16, 16, 64, 3, 3, [5, 1, 33, 16, 0, 0], None),  # SmolLM2's grouping (9 heads over 3)
    (F16, 32, 128, 1, 8, [70, 2], 4),
    (BF16, 32, 128, 2, 4, [1, 64, 31], 2),
    (F32, 16, 128, 1, 5, [48, 9], 1),
    (F16, 16, 64, 2, 2, [3, 0, 29, 1], 8),  # more partitions than blocks: empty partitions merge
    (BF16, 4, 64, 2, 2, [1, 6, 13], None),  # blocks under tl.dot's 16-row tile
    (F32, 4, 64, 2, 1, [5, 0, 9], None),  # the same, no GQA (a padded two-row tile)
    (F32, 32, 64, 2, 4, [0], None),  # padding rows alone
]


def _decode_case(dtype, block_size, head_dim, kv_heads, group, lens, parts, seed=0):
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    max_blocks = max(1, max(-(-n // block_size) for n in lens))
    num_blocks = len(lens) * max_blocks + 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    # Each row's blocks are a random, non-contiguous draw; table entries past a row's length are junk.
    perm = torch.randperm(num_blocks, generator=g)
    table = perm[: len(lens) * max_blocks].view(len(lens), max_blocks).to(torch.int32)
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    args = [t.to(DEV) for t in (q, k_cache, v_cache, table, ctx)]
    out = torch.full_like(args[0], float("nan"))  # poisoned: every element must be written
    got = triton_attention.paged_decode(*args, scale, num_parts=parts, out=out)
    return got, reference_decode(q, k_cache, v_cache, table, ctx, scale)


@pytest.mark.parametrize("dtype,block_size,head_dim,kv_heads,group,lens,parts", DECODE_CASES)
def test_paged_decode_matches_reference(dtype, block_size, head_dim, kv_heads, group, lens, parts):
    got, ref = _decode_case(dtype, block_size, head_dim, kv_heads, group, lens, parts)
    assert rel_err(got, ref) < REL[dtype]
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(got[i].cpu(), torch.zeros_like(got[i].cpu()))  # padding rows give zeros


@pytest.mark.slow
@pytest.mark.parametrize("dtype,group,parts", [(BF16, 3, None), (F32, 8, 16)])
def test_paged_decode_long_context(dtype, group, parts):
    """A long context spread over partitions, next to a one-token row."""
    got, ref = _decode_case(dtype, 32, 64, 1, group, [1500, 1, 300], parts, seed=3)
    assert rel_err(got, ref) < REL[dtype]


def test_paged_decode_reads_a_strided_layer_of_the_whole_cache():
    """The runner passes one layer's k, v as views of the [layers, 2, ...] cache tensor."""
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 2, 6, 16, 2, 64, generator=g)  # [layers, k/v, blocks, block_size, kvh, d]
    q = torch.randn(2, 4, 64, generator=g)
    table = torch.tensor([[4, 1], [2, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 7], dtype=torch.int32)
    got = triton_attention.paged_decode(q.to(DEV), kv[1, 0].to(DEV), kv[1, 1].to(DEV), table.to(DEV),
                                        lens.to(DEV), 0.125)
    assert rel_err(got, reference_decode(q, kv[1, 0], kv[1, 1], table, lens, 0.125)) < REL[F32]


def test_num_partitions_bounds():
    assert triton_attention.num_partitions(100, 1, 3) == 1  # one partition covers a short context
    assert triton_attention.num_partitions(8192, 1, 3) == triton_attention.MAX_PARTS
    assert triton_attention.num_partitions(8192, 256, 3) == 1  # the batch alone fills the device
    assert triton_attention.num_partitions(2048, 8, 3) == 8


@pytest.mark.parametrize("dtype,cols,rows", [(F32, 576, 3), (BF16, 576, 1), (F16, 2048, 5), (BF16, 100, 4)])
def test_add_rms_norm(dtype, cols, rows):
    g = torch.Generator().manual_seed(cols + rows)
    h = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
    d = torch.randn(rows, cols, generator=g).to(dtype)
    w = torch.randn(cols, generator=g).to(dtype)
    hd, dd, wd = (t.to(DEV, copy=True) for t in (h, d, w))  # copies: h is updated in place
    assert rel_err(triton_fused.rms_norm(hd, wd, 1e-5), rms_norm(h, w, 1e-5)) < REL[dtype]
    got = triton_fused.add_rms_norm_(hd, dd, wd, 1e-6)
    assert_rounded_like(hd, h + d)  # the residual stream, updated in place, rounded as torch rounds
    assert rel_err(got, rms_norm(h + d, w, 1e-6)) < REL[dtype]


@pytest.mark.parametrize("dtype,heads,kv_heads,dim", [(F32, 4, 2, 64), (BF16, 9, 3, 64), (F16, 8, 1, 128),
                                                      (BF16, 32, 4, 128)])
def test_rope_store_kv(dtype, heads, kv_heads, dim):
    block_size, tokens = 16, 5
    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    angles = torch.rand(tokens, dim // 2, generator=g) * 50
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [T, 1, dim] (RopeTables.lookup)
    slots = torch.tensor([3, 40, -1, 17, -1])  # rows 2 and 4 are padding: they write nowhere
    k_cache = torch.randn(4, block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(4, block_size, kv_heads, dim, generator=g).to(dtype)
    want_qk = apply_rope(qkv[:, : heads + kv_heads], cos, sin)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k_want.view(-1, kv_heads, dim)[s] = want_qk[t, heads:]
            v_want.view(-1, kv_heads, dim)[s] = qkv[t, heads + kv_heads:]
    x, kc, vc = (t.to(DEV, copy=True) for t in (qkv, k_cache, v_cache))
    triton_fused.rope_store_kv(x, cos.to(DEV), sin.to(DEV), kc, vc, slots.to(DEV), heads, kv_heads)
    assert_rounded_like(x[:, : heads + kv_heads], want_qk)  # the same roundings as torch's ops
    assert torch.equal(x[:, heads + kv_heads:].cpu(), qkv[:, heads + kv_heads:])  # v untouched
    assert_rounded_like(kc, k_want)  # only real rows' slots changed
    assert torch.equal(vc.cpu(), v_want)


@pytest.mark.parametrize("dtype,rows,inter", [(F32, 2, 1536), (BF16, 3, 100), (F16, 1, 2500)])
def test_silu_mul(dtype, rows, inter):
    gu = (torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)) * 6).to(dtype)
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp overflow and underflow
    gate, up = gu.chunk(2, dim=-1)
    got = triton_fused.silu_mul(gu.to(DEV)).cpu()
    want = F.silu(gate) * up
    if dtype == F32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # a rounding step apart at most (exp's last bit; the interpreter truncates bf16, see above)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

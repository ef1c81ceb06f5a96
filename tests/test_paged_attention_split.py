"""The paged decode kernel's work split: contexts cut into partitions (split-K) whose partial softmax states
are merged, each walked a block-bounded step at a time with the rows two steps ahead prefetched. Every cut
(partition edges, block edges, steps shorter than a block, blocks shorter than a step) on one and two threads
agrees with the torch gather + SDPA path; bad input is refused with a message naming what is wrong."""

from __future__ import annotations

import pytest
import torch

from gpuservd.runner import attention
from tests.test_paged_attention import _case, assert_kernel_matches_torch, kernel  # noqa: F401 - the fixture

# Context lengths around the kernel's cuts: 1 token, one step (32), one partition (256), a partition and one
# more token, two partitions exactly, and a long one of many partitions.
LENS = [1, 2, 31, 32, 33, 255, 256, 257, 512, 700, 1500]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [
    dict(heads=9, kv_heads=3, head_dim=64, block_size=16),  # SmolLM2: GQA 3, blocks shorter than a step
    dict(heads=9, kv_heads=3, head_dim=64, block_size=1),  # a step of one token
    dict(heads=9, kv_heads=3, head_dim=64, block_size=2),
    dict(heads=8, kv_heads=2, head_dim=32, block_size=64),  # GQA 4, blocks longer than a step
    dict(heads=4, kv_heads=4, head_dim=64, block_size=48),  # MHA, blocks not a power of two
])
def test_split_context_matches_torch_path(kernel, threads, shape):  # noqa: F811
    q, k_cache, v_cache, batch = _case(lens=LENS, **shape, dtype=torch.float32, seed=11)
    assert_kernel_matches_torch(kernel, threads, q, k_cache, v_cache, batch)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_few_long_sequences_split_over_the_threads(kernel, n, threads):  # noqa: F811
    """One to three long sequences: each is cut into partitions so that both threads have work, and the
    partial softmax states are merged into the torch path's result."""
    q, k_cache, v_cache, batch = _case(lens=[777 - 100 * i for i in range(n)], heads=9, kv_heads=3, head_dim=64,
                                       block_size=16, dtype=torch.float32, seed=12 + n)
    assert_kernel_matches_torch(kernel, threads, q, k_cache, v_cache, batch)  # head_dim 64: scale 0.125


@pytest.mark.parametrize("what,match", [
    ("lens_int64", "ctx_lens must be int32"),
    ("table_int64", "block_table must be int32"),
    ("heads_not_multiple", "multiple of kv heads"),
    ("head_dim", "head_dim of q and the cache differ"),
    ("dtype", "share a dtype"),
    ("rows", "block_table must be int32"),
])
def test_bad_input_is_refused_with_a_message(kernel, what, match):  # noqa: F811
    q, k_cache, v_cache, batch = _case(lens=[5, 20], heads=9, kv_heads=3, head_dim=64, block_size=16,
                                       dtype=torch.float32, seed=3)
    table, lens = batch.decode_block_table, batch.decode_ctx_lens
    if what == "lens_int64":
        lens = lens.long()
    elif what == "table_int64":
        table = table.long()
    elif what == "heads_not_multiple":
        q = q[:, :8]
    elif what == "head_dim":
        q = q[..., :32]
    elif what == "dtype":
        q = q.double()
    elif what == "rows":
        table = table[:1]
    with pytest.raises(RuntimeError, match=match):
        kernel(q, k_cache, v_cache, table, lens, 0.125)


def test_all_kernel_rows_need_no_k_and_v(kernel):  # noqa: F811
    """The fused layer hands paged_attention only q when every row attends in the kernel (it has stored this
    step's k and v already): the same output as with k and v given."""
    q, k_cache, v_cache, batch = _case(lens=[1, 40, 300], heads=9, kv_heads=3, head_dim=64, block_size=16,
                                       dtype=torch.float32, seed=8)
    assert batch.num_kernel_rows == q.shape[0]
    k = torch.randn(q.shape[0], 3, 64)
    got = attention.paged_attention(q, None, None, k_cache, v_cache, batch, 0.125, store_kv=False)
    want = attention.paged_attention(q, k, k, k_cache, v_cache, batch, 0.125, store_kv=False)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [
    dict(heads=4, kv_heads=2, head_dim=16, block_size=16),  # the tiny test models: GQA 2, 16-float V slices
    dict(heads=10, kv_heads=2, head_dim=24, block_size=3),  # GQA 5 (head blocks of 3 + 2), 8-float slices
    dict(heads=14, kv_heads=2, head_dim=40, block_size=48),  # GQA 7 (3 + 3 + 1), a step inside one block
    dict(heads=3, kv_heads=3, head_dim=8, block_size=5),  # one 8-float vector a head
])
def test_fp32_steps_across_blocks_and_head_blocks(kernel, threads, shape):  # noqa: F811
    """The fp32 item copies each 32-token step's rows from however many blocks it spans (blocks of 3, 5, 16
    or 48 tokens) and computes query heads in register blocks of up to 3: lengths around a step, a block and a
    partition agree with the torch path for group sizes 1 to 7 and head dims 8 to 40."""
    q, k_cache, v_cache, batch = _case(lens=[1, 3, 4, 31, 32, 33, 47, 65, 97, 257, 300], **shape,
                                       dtype=torch.float32, seed=21)
    assert_kernel_matches_torch(kernel, threads, q, k_cache, v_cache, batch)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [
    dict(heads=9, kv_heads=3, head_dim=64, block_size=16),  # SmolLM2 (the dot-product item on AVX512_BF16)
    dict(heads=9, kv_heads=3, head_dim=64, block_size=64),  # runs of up to 64 tokens
    dict(heads=8, kv_heads=1, head_dim=128, block_size=40),  # GQA 8, blocks not a power of two
    dict(heads=4, kv_heads=2, head_dim=128, block_size=17),
    dict(heads=5, kv_heads=5, head_dim=64, block_size=8),  # MHA, runs shorter than a 16-lane vector
])
def test_bf16_split_context_matches_fp32_reference(kernel, threads, shape):  # noqa: F811
    """bf16 items (the dot-product item where the CPU has AVX512_BF16, else the two-pass AVX2 item): lengths
    around 16 tokens, a block and a partition, on one and two threads, agree with the fp32 torch path on the
    same bf16 values."""
    q, k_cache, v_cache, batch = _case(lens=[1, 15, 16, 17, 31, 33, 64, 65, 100, 256, 257, 513], **shape,
                                       dtype=torch.bfloat16, seed=31)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel(q, k_cache, v_cache, batch.decode_block_table, batch.decode_ctx_lens, shape["head_dim"] ** -0.5)
    finally:
        torch.set_num_threads(before)
    want = attention.decode_attention_torch(q.float(), k_cache.float(), v_cache.float(), batch,
                                            shape["head_dim"] ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)

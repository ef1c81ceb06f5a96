"""One forward pass's flat batch: many sequences, prefill chunks and decode tokens mixed.

Tokens of all sequences are concatenated (no padding of the token batch).
Single-token chunks (decode) go first. Decode attention runs in groups of
sequences of similar context length: each group is one batched matmul over
its block tables padded to the group's longest context. Groups are cut so that
padding adds at most `MAX_PAD_WASTE` to the attention work: one batched op per
group is far cheaper on a CPU than one tiny op per block or per sequence,
and the bound keeps a single long sequence from inflating everyone's work.
Each prefill chunk attends on its own, except on the CPU, where chunks whose
context is at most `KERNEL_PREFILL_MAX_CTX` tokens join the decode rows in the
paged attention kernel's single call (one query row per token, each with its
causal context length): `kernel_*` below.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpuservd.runner.device_sampling import RowSampling

MAX_PAD_WASTE = 0.5  # padded context slots / real context tokens, per decode group
PAD_SLACK_TOKENS = 128  # sequences within this many tokens of the group's longest always join it
# Prefill chunks with at most this many context tokens attend in the paged kernel with the decode rows.
# Same-process, 2 threads, SmolLM2's heads: six ~43-token chunks from position 0 took 0.17 ms against
# 0.77 ms through one SDPA call each (bf16; 0.20 / 0.77 in fp32), one 256-token chunk 0.71 / 1.20 ms;
# at 512 context tokens both took the same time, at 1024 the kernel (a query row at a time, no tiling)
# was 1.05x (bf16) to 1.5x (fp32) slower than SDPA's flash kernel.
KERNEL_PREFILL_MAX_CTX = 512


@dataclass
class SeqChunk:
    """One sequence's slice of a forward pass."""

    token_ids: list[int]  # tokens fed this step (a prefill chunk, or the last sampled token)
    start_pos: int  # absolute position of token_ids[0]; KV for [0, start_pos) is already cached
    block_ids: list[int]  # block table covering positions [0, start_pos + len(token_ids))
    sample: bool  # whether logits of the chunk's last token are needed
    # Token ids that end the sequence (its EOS ids unless ignored, its stop ids): the fixed-shape decode
    # step checks its chosen token against them on the device (decode_step.py).
    stop_ids: tuple[int, ...] = ()
    # How the fixed-shape step chooses this row's token on the device: None = greedy (the argmax), else
    # its sampling parameters and seed (device_sampling.py). Other paths ignore it.
    sampling: RowSampling | None = None
    # The logits of every token of the chunk are needed too (prompt logprobs): returned after the
    # sampled rows (see build_batch's logits_indices).
    all_logits: bool = False


@dataclass
class PrefillMeta:
    """Attention metadata of one multi-token chunk."""

    q_start: int  # offset of the chunk in the flat token batch
    q_len: int  # tokens in the chunk
    ctx_len: int  # cached tokens before the chunk + q_len
    block_ids: torch.Tensor  # [ceil(ctx_len / block_size)] block table
    kernel: bool = False  # attends among the kernel rows (see ForwardBatch.num_kernel_rows)


@dataclass
class DecodeGroup:
    """Decode sequences attended together; b = sequences, nblk = the longest one's blocks."""

    rows: torch.Tensor  # [b] rows of these sequences in the flat token batch
    block_table: torch.Tensor  # [b, nblk] block ids, padded with block 0
    max_len: int  # the longest context in the group
    mask: torch.Tensor | None  # [b, max_len] bool: position holds a real token; None when all lengths are equal


@dataclass
class ForwardBatch:
    """Flat tensors for one forward; T = total tokens, NB = decode blocks."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat cache slot (block * block_size + offset) where each token's K/V goes
    num_decode: int  # the first num_decode tokens are one-token chunks, one per sequence
    decode_groups: Sequence[DecodeGroup]  # the decode sequences, grouped by context length (LazyDecodeGroups)
    decode_block_table: torch.Tensor  # [num_decode, max blocks] int32, rows padded with block 0 (C++ kernel)
    decode_ctx_lens: torch.Tensor  # [num_decode] int32 context length of each decode sequence (C++ kernel)
    prefills: list[PrefillMeta]  # one per multi-token chunk
    # [S + P] token rows whose logits are returned: the S chunks with sample=True (their last token), in
    # input chunk order, then the P other rows of the chunks with all_logits, in chunk and token order.
    logits_indices: torch.Tensor
    # CPU only: the first num_kernel_rows token rows (the decode rows, then the prefill chunks marked
    # `kernel`) attend in one paged-kernel call, each row with its own causal context length.
    num_kernel_rows: int = 0
    kernel_block_table: torch.Tensor | None = None  # [num_kernel_rows, max blocks] int32
    kernel_ctx_lens: torch.Tensor | None = None  # [num_kernel_rows] int32

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def group_decodes(ctx_lens: list[int]) -> list[list[int]]:
    """Split decode sequences (by index) into groups of similar context length."""
    order = sorted(range(len(ctx_lens)), key=lambda i: -ctx_lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups:
            g = groups[-1]
            longest = ctx_lens[g[0]]
            real = sum(ctx_lens[j] for j in g) + ctx_lens[i]
            padded = longest * (len(g) + 1)
            if longest - ctx_lens[i] <= PAD_SLACK_TOKENS or padded <= (1 + MAX_PAD_WASTE) * real:
                g.append(i)
                continue
        groups.append([i])
    return groups


def _decode_groups(dec_ctx: list[int], dec_tables: list[list[int]], device: torch.device) -> list[DecodeGroup]:
    """The decode rows in groups of similar context length (group_decodes), each with its padded block
    table and, where lengths differ, the mask of the padding."""
    groups = []
    for members in group_decodes(dec_ctx):
        nblk = len(dec_tables[members[0]])
        members = sorted(members)  # ascending rows: a single group is then the identity order
        table = [dec_tables[j] + [0] * (nblk - len(dec_tables[j])) for j in members]
        lens = [dec_ctx[j] for j in members]
        longest = max(lens)
        mask = None
        if min(lens) != longest:
            mask = (torch.arange(longest)[None, :] < torch.tensor(lens)[:, None]).to(device)
        groups.append(
            DecodeGroup(
                rows=torch.tensor(members, dtype=torch.long, device=device),
                block_table=torch.tensor(table, dtype=torch.long, device=device),
                max_len=longest,
                mask=mask,
            )
        )
    return groups


class LazyDecodeGroups(Sequence):
    """A batch's decode groups, built when first read. Only the torch attention path reads them (the CPU
    and CUDA kernels take the block table and the context lengths), and building them was half of
    build_batch's time: 0.12 of 0.22 ms (min of 300, one core) at 48 decode rows, on the engine's thread
    every step."""

    def __init__(self, dec_ctx: list[int], dec_tables: list[list[int]], device: torch.device):
        self._args = (dec_ctx, dec_tables, device)
        self._groups: list[DecodeGroup] | None = None

    def _built(self) -> list[DecodeGroup]:
        if self._groups is None:
            self._groups = _decode_groups(*self._args)
        return self._groups

    def __len__(self) -> int:
        return len(self._built())

    def __getitem__(self, i):
        return self._built()[i]


def _all_logit_rows(chunks: list[SeqChunk], last_row: list[int]) -> list[int]:
    """The rows of the all_logits chunks that are not already sampled rows (chunk i's rows end at last_row[i])."""
    rows: list[int] = []
    for i, c in enumerate(chunks):
        if c.all_logits:
            end = last_row[i] + (0 if c.sample else 1)
            rows.extend(range(last_row[i] + 1 - len(c.token_ids), end))
    return rows


def build_batch(chunks: list[SeqChunk], block_size: int, device: torch.device) -> ForwardBatch:
    """Lay out chunks as a flat batch (decode chunks first) and compute all indices."""
    # Decode rows, then the prefill chunks the CPU kernel takes, then the rest: the kernel's rows are
    # a prefix of the token batch.
    kernel_ok = device.type == "cpu"

    def rank(i: int) -> int:
        c = chunks[i]
        if len(c.token_ids) == 1:
            return 0
        return 1 if kernel_ok and c.start_pos + len(c.token_ids) <= KERNEL_PREFILL_MAX_CTX else 2

    order = sorted(range(len(chunks)), key=rank)
    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    dec_ctx: list[int] = []  # context length of each decode sequence
    dec_tables: list[list[int]] = []
    prefills: list[PrefillMeta] = []
    last_row = [0] * len(chunks)
    for i in order:
        c = chunks[i]
        n = len(c.token_ids)
        if n == 0:
            raise ValueError("empty chunk")
        ctx = c.start_pos + n
        need = -(-ctx // block_size)
        if len(c.block_ids) < need:
            raise ValueError(f"chunk needs {need} blocks for {ctx} tokens, has {len(c.block_ids)}")
        q_start = len(ids)
        ids.extend(c.token_ids)
        for p in range(c.start_pos, ctx):
            pos.append(p)
            slots.append(c.block_ids[p // block_size] * block_size + p % block_size)
        last_row[i] = q_start + n - 1
        if n == 1:
            dec_ctx.append(ctx)
            dec_tables.append(c.block_ids[:need])
        else:
            prefills.append(PrefillMeta(q_start, n, ctx, torch.tensor(c.block_ids[:need], device=device),
                                        kernel=rank(i) == 1))
    groups = LazyDecodeGroups(dec_ctx, dec_tables, device)
    max_blocks = max((len(t) for t in dec_tables), default=0)
    decode_block_table = torch.tensor(
        [t + [0] * (max_blocks - len(t)) for t in dec_tables], dtype=torch.int32, device=device
    ).view(len(dec_tables), max_blocks)
    decode_ctx_lens = torch.tensor(dec_ctx, dtype=torch.int32, device=device)
    kernel = _kernel_rows(decode_block_table, decode_ctx_lens, [m for m in prefills if m.kernel]) if kernel_ok else None
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        num_decode=len(dec_ctx),
        decode_groups=groups,
        decode_block_table=decode_block_table,
        decode_ctx_lens=decode_ctx_lens,
        prefills=prefills,
        logits_indices=torch.tensor(
            [last_row[i] for i in range(len(chunks)) if chunks[i].sample] + _all_logit_rows(chunks, last_row),
            dtype=torch.long, device=device),
        num_kernel_rows=0 if kernel is None else int(kernel[1].shape[0]),
        kernel_block_table=None if kernel is None else kernel[0],
        kernel_ctx_lens=None if kernel is None else kernel[1],
    )


def _kernel_rows(decode_table: torch.Tensor, decode_lens: torch.Tensor,
                 prefills: list[PrefillMeta]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block table and context length of every kernel row: the decode rows as they are, then one row
    per token of each kernel prefill chunk (its chunk's table; context up to and including itself)."""
    if not prefills:
        return decode_table, decode_lens
    width = max([decode_table.shape[1]] + [int(m.block_ids.shape[0]) for m in prefills])
    tables = [torch.nn.functional.pad(decode_table, (0, width - decode_table.shape[1]))]
    lens = [decode_lens]
    for m in prefills:
        row = torch.nn.functional.pad(m.block_ids.to(torch.int32), (0, width - int(m.block_ids.shape[0])))
        tables.append(row.expand(m.q_len, width))
        lens.append(torch.arange(m.ctx_len - m.q_len + 1, m.ctx_len + 1, dtype=torch.int32))
    return torch.cat(tables).contiguous(), torch.cat(lens)

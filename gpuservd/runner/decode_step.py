"""The fixed-shape decode step: a decode-only batch padded to a bucket size, read from persistent buffers.

A decode step of n sequences runs as a batch of b rows, b the smallest
bucket >= n (default buckets 1, 2, 4, ..., 256; `engine.cuda_graphs.
batch_sizes`). Its inputs live in one persistent device buffer that the
forward reads through fixed views, so the same kernels with the same
pointers serve every step of that bucket; that is what lets a CUDA graph
captured once per bucket replay for any batch (cuda_graphs.py). Per step the
host writes the rows into one pinned staging buffer and makes one
non-blocking copy of it (the build_batch path makes about ten synchronous
`torch.tensor(..., device=cuda)` copies).

Buffer layout, int64 words: token ids [M] | positions [M] | slots [M] |
stop ids [M, MAX_STOP_IDS] | then an int32 region: context lengths [M]
(padded to whole words) | block tables [M, max_blocks]. M = the largest
bucket; max_blocks covers the model's context length. A step of bucket b
copies everything before the tables and the first b table rows only.

The step also chooses on the device: the greedy argmax of every row and
whether it is one of the row's stop ids, packed as [2, b] int64 so that one
small copy brings both to the host (`DecodeResult.host()`). A row with more
than MAX_STOP_IDS stop ids gets no device verdict (None): the engine checks
it on the host as before.

Padding rows (n..b-1) have token 0, position 0, slot -1 (the KV store writes
nowhere: triton_fused / the C++ rope_store_kv skip it) and context length 0
(attention reads no block and returns zeros), so they touch no sequence's
KV; their logits are computed and dropped.

The step needs the fused kernels (C++ on the CPU, Triton on CUDA): the torch
fallback path writes KV with index_copy_ and groups decode rows on the host,
neither of which a fixed shape or slot -1 fits. Without them the runner keeps
build_batch's path. On the CPU the step runs eagerly (no graphs); the tests
check there that padded buckets give the unpadded path's greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gpuservd.config import DEFAULT_CUDA_GRAPH_BATCH_SIZES, check_batch_sizes
from gpuservd.runner.batch import ForwardBatch, SeqChunk

MAX_STOP_IDS = 8  # stop ids per row checked on the device

def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds n rows, or None when n is above the largest."""
    for b in sizes:
        if b >= n:
            return b
    return None


class DecodeInputs:
    """The persistent buffers of the fixed-shape step (device) and their pinned staging copy (host)."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device):
        m = max_batch
        self.max_batch, self.max_blocks = m, max_blocks
        self._lens_words = -(-m // 2)  # m int32 lengths in whole int64 words
        self._head = (3 + MAX_STOP_IDS) * m  # int64 words before the int32 region
        words = self._head + self._lens_words + -(-(m * max_blocks) // 2)
        pin = device.type == "cuda"
        self.staging = torch.zeros(words, dtype=torch.int64, pin_memory=pin)
        # On the CPU the staging buffer is the buffer the forward reads: nothing to copy.
        self.device_buf = torch.zeros(words, dtype=torch.int64, device=device) if pin else self.staging
        self.token_ids, self.positions, self.slots = self._id_views(self.device_buf)
        self.stop_ids = self.device_buf[3 * m: self._head].view(m, MAX_STOP_IDS)  # -1 = none
        self.ctx_lens, self.block_tables = self._int32_views(self.device_buf)
        # Host views of the staging buffer, as numpy arrays over the same memory.
        host = self.staging.numpy()
        self._h_ids, self._h_pos, self._h_slots = host[:m], host[m: 2 * m], host[2 * m: 3 * m]
        self._h_stop = host[3 * m: self._head].reshape(m, MAX_STOP_IDS)
        self.unchecked: list[int] = []  # rows of the last fill whose stop ids did not fit
        tail = host[self._head:].view(np.int32)
        self._h_lens = tail[:m]
        self._h_tables = tail[2 * self._lens_words: 2 * self._lens_words + m * max_blocks].reshape(m, max_blocks)
        self.rows = torch.arange(m, dtype=torch.long, device=device)  # logits_indices of every bucket

    def _id_views(self, buf: torch.Tensor):
        m = self.max_batch
        return buf[:m], buf[m: 2 * m], buf[2 * m: 3 * m]

    def _int32_views(self, buf: torch.Tensor):
        m = self.max_batch
        tail = buf[self._head:].view(torch.int32)
        lens = tail[:m]
        start = 2 * self._lens_words
        return lens, tail[start: start + m * self.max_blocks].view(m, self.max_blocks)

    def fill(self, chunks: list[SeqChunk], bucket: int, block_size: int) -> None:
        """Write n decode chunks and bucket - n padding rows, then one non-blocking copy to the device."""
        n = len(chunks)
        if not 0 < n <= bucket <= self.max_batch:
            raise ValueError(f"{n} rows do not fit bucket {bucket} (largest {self.max_batch})")
        bs = block_size
        p = [c.start_pos for c in chunks]
        tables, stop = self._h_tables, self._h_stop
        stop[:bucket] = -1
        self.unchecked = []
        slot_list = []
        # Scalars per row go in as whole arrays; only the block tables and stop ids are written row by row.
        for i, c in enumerate(chunks):
            need = p[i] // bs + 1
            if len(c.token_ids) != 1 or len(c.block_ids) < need:
                raise ValueError(f"row {i} is not a decode chunk with blocks covering position {p[i]}")
            if need > self.max_blocks:
                raise ValueError(f"row {i} needs {need} blocks, the table holds {self.max_blocks}")
            blocks = c.block_ids
            slot_list.append(blocks[need - 1] * bs + p[i] % bs)
            tables[i, :need] = blocks[:need]
            if len(c.stop_ids) <= MAX_STOP_IDS:
                stop[i, : len(c.stop_ids)] = c.stop_ids
            else:
                self.unchecked.append(i)
        self._h_ids[:n] = [c.token_ids[0] for c in chunks]
        self._h_pos[:n] = p
        self._h_lens[:n] = self._h_pos[:n] + 1
        self._h_slots[:n] = slot_list
        self._h_ids[n:bucket], self._h_pos[n:bucket], self._h_slots[n:bucket], self._h_lens[n:bucket] = 0, 0, -1, 0
        # Everything before the tables, and the first `bucket` table rows, are one prefix of the buffer.
        if self.device_buf is not self.staging:
            words = self._head + self._lens_words + -(-(bucket * self.max_blocks) // 2)
            self.device_buf[:words].copy_(self.staging[:words], non_blocking=True)

    def batch(self, bucket: int) -> ForwardBatch:
        """The ForwardBatch of a bucket: fixed views of the device buffer (the same tensors every step)."""
        b = bucket
        table, lens = self.block_tables[:b], self.ctx_lens[:b]
        return ForwardBatch(
            input_ids=self.token_ids[:b], positions=self.positions[:b], slots=self.slots[:b],
            num_decode=b, decode_groups=[], decode_block_table=table, decode_ctx_lens=lens, prefills=[],
            logits_indices=self.rows[:b],
            # On the CPU the paged kernel takes every row (attention.paged_attention's kernel rows).
            num_kernel_rows=b, kernel_block_table=table, kernel_ctx_lens=lens,
        )


class DecodeStep:
    """Runs decode-only steps as bucket-padded batches; eagerly, or through captured graphs when set."""

    def __init__(self, model, cache, block_size: int, max_model_len: int, batch_sizes=DEFAULT_CUDA_GRAPH_BATCH_SIZES):
        self.model = model
        self.cache = cache
        self.block_size = block_size
        self.batch_sizes = check_batch_sizes(batch_sizes)
        max_blocks = -(-max_model_len // block_size)
        self.inputs = DecodeInputs(self.batch_sizes[-1], max_blocks, model.device)
        self._batches = {b: self.inputs.batch(b) for b in self.batch_sizes}
        self.graphs = None  # cuda_graphs.DecodeGraphs once captured (CUDA only)
        self.last_path = ""  # "graph" or "eager": how the last step ran

    def takes(self, chunks: list[SeqChunk]) -> bool:
        """Whether this step runs the chunks: all one-token chunks that sample, within the largest bucket."""
        return (0 < len(chunks) <= self.batch_sizes[-1]
                and all(len(c.token_ids) == 1 and c.sample and not c.all_logits for c in chunks))

    def run(self, chunks: list[SeqChunk], between=None) -> "DecodeResult":
        """The step for n decode chunks: their logits [n, V] (fp32) and, chosen on the device, their
        greedy ids and stop verdicts. between(layer) is called after each layer (the sharing arbiter's
        yield point; it must return False: decode is never suspended)."""
        n = len(chunks)
        bucket = bucket_for(n, self.batch_sizes)
        self.inputs.fill(chunks, bucket, self.block_size)
        g = self.graphs
        if g is not None and g.has(bucket, segmented=between is not None):
            logits, chosen = g.replay(bucket, between)
            self.last_path = "graph"
        else:
            logits, chosen = self.forward_and_choose(bucket, between)
            self.last_path = "eager"
        return DecodeResult(logits[:n], chosen[:, :n], list(self.inputs.unchecked))

    def batch(self, bucket: int) -> ForwardBatch:
        return self._batches[bucket]

    def forward(self, bucket: int, between=None) -> torch.Tensor:
        """The eager forward of a bucket over the buffers as they are: logits [bucket, V]."""
        return self.model.forward(self._batches[bucket], self.cache.layer, suspend=between)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[2, b] int64: each row's greedy id, and 1 where that id is one of the row's stop ids."""
        greedy = torch.argmax(logits, dim=-1)
        hit = (greedy[:, None] == self.inputs.stop_ids[: logits.shape[0]]).any(-1)
        return torch.stack([greedy, hit.to(torch.int64)])

    def forward_and_choose(self, bucket: int, between=None) -> tuple[torch.Tensor, torch.Tensor]:
        """What one graph holds: the forward, then the choice on the device."""
        logits = self.forward(bucket, between)
        return logits, self.choose(logits)


@dataclass
class DecodeResult:
    """A fixed-shape step's output, on the device."""

    logits: torch.Tensor  # [n, V] fp32
    chosen: torch.Tensor  # [2, n] int64: the greedy ids; 1 where the id is one of the row's stop ids
    unchecked: list[int]  # rows whose stop ids did not fit the device check (checked on the host)

    @property
    def greedy(self) -> torch.Tensor:
        return self.chosen[0]

    def host(self) -> tuple[list[int], list[bool | None]]:
        """Greedy ids and stop verdicts (None: not checked on the device), in one copy to the host."""
        ids, hits = self.chosen.tolist()
        stops: list[bool | None] = [bool(h) for h in hits]
        for i in self.unchecked:
            stops[i] = None
        return ids, stops

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
id sources [M] | seeds [M] | draw counters [M] | top_k [M] | then float64:
temperature [M] | top_p [M] | min_p [M] | then int64 stop ids [M, MAX_STOP_IDS]
| then an int32 region: context lengths [M] (padded to whole words) | block
tables [M, max_blocks]. M = the largest bucket; max_blocks covers the model's
context length. A step of bucket b copies everything before the tables and
the first b table rows only. There are two staging buffers, used in turn, so
the host fills the next step's while the last one's copy may still be in
flight (the overlap of engine/engine.py).

The step also chooses on the device. Greedy rows take the argmax inside the
forward's graph; when any row samples (temperature, top_k, top_p, min_p and a
seed: SeqChunk.sampling), device_sampling.choose picks every row's token after
the forward, as a second graph per bucket. Then each chosen id is checked
against the row's stop ids, and ids and verdicts are packed as [2, b] int64 and
copied to a pinned host buffer without blocking (`DecodeResult.host()` waits
for that one small copy). A row with more than MAX_STOP_IDS stop ids gets no
device verdict (None): the engine checks it on the host as before.

A row's token may come from the previous step's choice without the host
having seen it (id source >= 0: that step's row): the step gathers it from
the persistent buffer of last chosen ids on the device, inside the graph, so
the engine can launch step N+1 before reading step N's ids.

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
from gpuservd.runner import device_sampling
from gpuservd.runner.batch import ForwardBatch, SeqChunk
from gpuservd.runner.device_sampling import stop_hits

MAX_STOP_IDS = 8  # stop ids per row checked on the device

def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds n rows, or None when n is above the largest."""
    for b in sizes:
        if b >= n:
            return b
    return None


class _Host:
    """numpy views of one staging buffer, laid out as the device buffer (see the module docstring)."""

    def __init__(self, staging: torch.Tensor, m: int, max_blocks: int, head: int, lens_words: int):
        host = staging.numpy()
        self.ids, self.pos, self.slots, self.src = (host[i * m: (i + 1) * m] for i in range(4))
        self.seeds, self.steps, self.top_k = (host[i * m: (i + 1) * m] for i in range(4, 7))
        floats = host[7 * m: 10 * m].view(np.float64)
        self.temperature, self.top_p, self.min_p = floats[:m], floats[m: 2 * m], floats[2 * m:]
        self.stop = host[10 * m: head].reshape(m, MAX_STOP_IDS)
        tail = host[head:].view(np.int32)
        self.lens = tail[:m]
        self.tables = tail[2 * lens_words: 2 * lens_words + m * max_blocks].reshape(m, max_blocks)


class DecodeInputs:
    """The persistent buffers of the fixed-shape step (device) and their pinned staging copies (host)."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device):
        m = max_batch
        self.max_batch, self.max_blocks = m, max_blocks
        self._lens_words = -(-m // 2)  # m int32 lengths in whole int64 words
        self._head = (10 + MAX_STOP_IDS) * m  # int64 words before the int32 region
        words = self._head + self._lens_words + -(-(m * max_blocks) // 2)
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.device_buf = torch.zeros(words, dtype=torch.int64, device=device)
            self.staging = [torch.zeros(words, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        else:  # on the CPU the staging buffer is the buffer the forward reads: nothing to copy
            self.device_buf = torch.zeros(words, dtype=torch.int64)
            self.staging = [self.device_buf]
        self._host = [_Host(st, m, max_blocks, self._head, self._lens_words) for st in self.staging]
        self._copied: list = [None] * len(self.staging)  # CUDA events: each staging buffer's last copy done
        self._turn = 0
        buf = self.device_buf
        self.token_ids, self.positions, self.slots, self.src = (buf[i * m: (i + 1) * m] for i in range(4))
        self.seeds, self.steps, self.top_k = (buf[i * m: (i + 1) * m] for i in range(4, 7))
        floats = buf[7 * m: 10 * m].view(torch.float64)
        self.temperature, self.top_p, self.min_p = floats[:m], floats[m: 2 * m], floats[2 * m:]
        self.stop_ids = buf[10 * m: self._head].view(m, MAX_STOP_IDS)  # -1 = none
        tail = buf[self._head:].view(torch.int32)
        self.ctx_lens = tail[:m]
        start = 2 * self._lens_words
        self.block_tables = tail[start: start + m * max_blocks].view(m, max_blocks)
        self.unchecked: list[int] = []  # rows of the last fill whose stop ids did not fit
        self.sampled = False  # whether any row of the last fill samples (SeqChunk.sampling)
        self.rows = torch.arange(m, dtype=torch.long, device=device)  # logits_indices of every bucket

    def neutral(self) -> None:
        """Every row a padding row that samples nothing (before a capture: no KV written or read)."""
        self.token_ids.zero_(), self.positions.zero_(), self.slots.fill_(-1), self.src.fill_(-1)
        self.seeds.zero_(), self.steps.zero_(), self.top_k.zero_()
        self.temperature.zero_(), self.top_p.fill_(1.0), self.min_p.zero_()
        self.stop_ids.fill_(-1), self.ctx_lens.zero_()

    def fill(self, chunks: list[SeqChunk], bucket: int, block_size: int, sources: Sequence[int] | None = None) -> None:
        """Write n decode chunks and bucket - n padding rows, then one non-blocking copy to the device.
        sources[i] >= 0: row i's token is what the previous step chose in that row (still on the device)."""
        n = len(chunks)
        if not 0 < n <= bucket <= self.max_batch:
            raise ValueError(f"{n} rows do not fit bucket {bucket} (largest {self.max_batch})")
        k = self._turn
        self._turn = (k + 1) % len(self.staging)
        if self._copied[k] is not None:
            self._copied[k].synchronize()  # its last copy (two steps ago) has left the buffer
        h = self._host[k]
        bs = block_size
        p = [c.start_pos for c in chunks]
        h.stop[:bucket] = -1
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
            h.tables[i, :need] = blocks[:need]
            if len(c.stop_ids) <= MAX_STOP_IDS:
                h.stop[i, : len(c.stop_ids)] = c.stop_ids
            else:
                self.unchecked.append(i)
        h.ids[:n] = [max(0, c.token_ids[0]) for c in chunks]  # an id still on the device: a placeholder
        h.pos[:n] = p
        h.lens[:n] = h.pos[:n] + 1
        h.slots[:n] = slot_list
        h.src[:n] = sources if sources is not None else -1
        h.ids[n:bucket], h.pos[n:bucket], h.slots[n:bucket], h.lens[n:bucket], h.src[n:bucket] = 0, 0, -1, 0, -1
        self._fill_sampling(h, chunks, bucket)
        # Everything before the tables, and the first `bucket` table rows, are one prefix of the buffer.
        if self.cuda:
            words = self._head + self._lens_words + -(-(bucket * self.max_blocks) // 2)
            self.device_buf[:words].copy_(self.staging[k][:words], non_blocking=True)
            self._copied[k] = torch.cuda.Event()
            self._copied[k].record()

    def _fill_sampling(self, h: _Host, chunks: list[SeqChunk], bucket: int) -> None:
        """Each row's sampling parameters; greedy (and padding) rows: temperature 0, nothing truncated."""
        h.temperature[:bucket], h.top_k[:bucket], h.top_p[:bucket], h.min_p[:bucket] = 0.0, 0, 1.0, 0.0
        h.seeds[:bucket], h.steps[:bucket] = 0, 0
        rows = [(i, c.sampling) for i, c in enumerate(chunks) if c.sampling is not None]
        self.sampled = bool(rows)
        for i, r in rows:
            h.temperature[i], h.top_k[i], h.top_p[i], h.min_p[i] = r.temperature, r.top_k, r.top_p, r.min_p
            h.seeds[i], h.steps[i] = r.seed & 0x7FFFFFFFFFFFFFFF, r.step

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
        m, dev = self.batch_sizes[-1], model.device
        # The last step's chosen ids, on the device: where a row's token comes from when the host has not
        # read it yet (DecodeInputs.src).
        self.last_ids = torch.zeros(m, dtype=torch.long, device=dev)
        # Where the chosen ids and verdicts land on the host: two buffers, used in turn, so one step's copy
        # can be in flight while the previous step's is read.
        pin = dev.type == "cuda"
        self._host = [torch.zeros(2, m, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self.graphs = None  # cuda_graphs.DecodeGraphs once captured (CUDA only)
        self.last_path = ""  # "graph" or "eager": how the last step ran

    def takes(self, chunks: list[SeqChunk]) -> bool:
        """Whether this step runs the chunks: all one-token chunks that sample, within the largest bucket."""
        return (0 < len(chunks) <= self.batch_sizes[-1]
                and all(len(c.token_ids) == 1 and c.sample and not c.all_logits for c in chunks))

    def run(self, chunks: list[SeqChunk], between=None, sources: Sequence[int] | None = None) -> "DecodeResult":
        """The step for n decode chunks: their logits [n, V] (fp32) and, chosen on the device, their
        ids (greedy, or drawn where a chunk carries sampling parameters) and stop verdicts, already on
        their way to the host. between(layer) is called after each layer (the sharing arbiter's yield
        point; it must return False: decode is never suspended). sources: see DecodeInputs.fill."""
        n = len(chunks)
        bucket = bucket_for(n, self.batch_sizes)
        self.inputs.fill(chunks, bucket, self.block_size, sources)
        sampled = self.inputs.sampled
        g = self.graphs
        segmented = between is not None
        if g is not None and g.has(bucket, segmented=segmented):
            logits, chosen = g.replay(bucket, between)
            if sampled:
                chosen = g.replay_sampler(bucket, segmented)
            self.last_path = "graph"
        else:
            logits, chosen = self.forward_and_choose(bucket, between)
            if sampled:
                chosen = self.sample(logits)
            self.last_path = "eager"
        host = self._host[self._turn]
        self._turn ^= 1
        host[:, :n].copy_(chosen[:, :n], non_blocking=True)
        event = None
        if host.is_pinned():
            event = torch.cuda.Event()
            event.record()
        return DecodeResult(logits[:n], chosen[:, :n], list(self.inputs.unchecked), sampled, host[:, :n], event)

    def batch(self, bucket: int) -> ForwardBatch:
        return self._batches[bucket]

    def resolve_ids(self, bucket: int) -> None:
        """Rows whose token the previous step chose on the device take it from there (in place)."""
        ids, src = self.inputs.token_ids[:bucket], self.inputs.src[:bucket]
        ids.copy_(torch.where(src >= 0, self.last_ids[src.clamp(min=0)], ids))

    def forward(self, bucket: int, between=None) -> torch.Tensor:
        """The eager forward of a bucket over the buffers as they are: logits [bucket, V]."""
        self.resolve_ids(bucket)
        return self.model.forward(self._batches[bucket], self.cache.layer, suspend=between)

    def _pack(self, ids: torch.Tensor) -> torch.Tensor:
        """[2, b] int64: the chosen ids, and 1 where one is among its row's stop ids; kept as the next
        step's id source."""
        self.last_ids[: ids.shape[0]].copy_(ids)
        return torch.stack([ids, stop_hits(ids, self.inputs.stop_ids[: ids.shape[0]])])

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """Every row's greedy id and its stop verdict, [2, b]."""
        return self._pack(torch.argmax(logits, dim=-1))

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """Every row's chosen id (greedy rows the argmax, sampling rows a draw) and its stop verdict, [2, b]."""
        b, inp = logits.shape[0], self.inputs
        ids = device_sampling.choose(logits, inp.temperature[:b].float(), inp.top_k[:b], inp.top_p[:b].float(),
                                     inp.min_p[:b].float(), inp.seeds[:b], inp.steps[:b])
        return self._pack(ids)

    def forward_and_choose(self, bucket: int, between=None) -> tuple[torch.Tensor, torch.Tensor]:
        """What one graph holds: the forward, then the greedy choice on the device."""
        logits = self.forward(bucket, between)
        return logits, self.choose(logits)


@dataclass
class DecodeResult:
    """A fixed-shape step's output: on the device, and the chosen ids on their way to the host."""

    logits: torch.Tensor  # [n, V] fp32
    chosen: torch.Tensor  # [2, n] int64: the chosen ids; 1 where the id is one of the row's stop ids
    unchecked: list[int]  # rows whose stop ids did not fit the device check (checked on the host)
    sampled: bool = False  # the ids were drawn with the rows' sampling parameters (else all greedy)
    host_copy: torch.Tensor | None = None  # [2, n] on the host, being filled from `chosen`
    copied: object = None  # a CUDA event: host_copy is complete (None: it already is)

    @property
    def greedy(self) -> torch.Tensor:
        """[n]: the argmax of every greedy row's logits (of every row when none sampled)."""
        return self.chosen[0]

    def host(self) -> tuple[list[int], list[bool | None]]:
        """Chosen ids and stop verdicts (None: not checked on the device), from the one small copy."""
        if self.copied is not None:
            self.copied.synchronize()
        ids, hits = (self.host_copy if self.host_copy is not None else self.chosen).tolist()
        stops: list[bool | None] = [bool(h) for h in hits]
        for i in self.unchecked:
            stops[i] = None
        return ids, stops

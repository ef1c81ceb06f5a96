"""CUDA graphs of the fixed-shape decode step (decode_step.py): one per bucket, captured at engine start.

On the GPU a small model's decode step is launch-bound: ~35 kernels a layer,
each a few microseconds of Python and launch overhead, against well under a
microsecond of memory traffic. A graph replays the whole forward (embedding,
every layer, final norm, LM head, the greedy argmax and the stop-id check)
as one launch. A step where some row samples (temperature, top_k, top_p)
replays a second graph per bucket after it: the device sampler
(device_sampling.py) over the first graph's static logits.

Capture: after the weights are complete, for every bucket from the largest
down (smaller graphs reuse the larger ones' memory), all sharing one memory
pool: one eager warm-up run per bucket on a side stream (Triton compiles,
cuBLAS picks its kernels, the allocator settles), then the capture. The
inputs during warm-up and capture are padding rows only (slot -1, length 0),
so no KV block is written. One log line reports the buckets and the seconds
it took. Capture uses thread-local error mode, so another engine's thread
doing CUDA work meanwhile (GPU sharing) does not break it.

Replay: `DecodeStep.run` fills the persistent inputs (one pinned staging
buffer, one non-blocking copy on the current stream) and replays the bucket's
graph on the same stream; the caller reads the logits or the greedy ids
afterwards, which synchronizes. The staging buffer is rewritten only on the
next step, after that read, so the copy never races its refill.

Mixed steps (prefill chunks + decode rows) run eagerly as one batch, not as
eager prefill + graphed decode: the decode rows then share every weight read
with the prefill tokens (at decode batch sizes each layer is a pass over its
weights; two passes, one per part, would read the weights twice), and a step
that carries a prefill chunk is dominated by that chunk's matrix work, so the
launches a graph saves are a small share of it. (vLLM's piecewise graphs and
SGLang's decode-only graphs make the same split of roles.) The benchmark
(gpuservd/bench/fast_decode.py) times one such step both ways on the device.

What cannot live inside one graph, and what happens instead:
- The sharing arbiter's per-layer yields (time slices between models) are
  Python calls between layers, which a graph would run once at capture and
  never again. While the engine has a yield point, decode steps replay
  per-layer segment graphs instead: `capture(segmented=True)` captures, per
  bucket, one graph per layer boundary (embedding + layer 0, each further
  layer, the last layer + LM head), chained through static hidden-state
  buffers (the LayerCheckpoint of llama.py), and the yield runs between
  segment replays; the half-layer yield inside a layer is not kept (a
  neighbour waits up to one layer instead of half of one). Layer-granular
  suspension only applies to steps that carry prefill, which run eagerly.
- Green-context partitions: the engine is built, and its graphs captured, on
  its own engine thread after `sharing.bind` has made the partition's stream
  current; capture records the kernels, and each replay launches them on the
  thread's current stream, which is the partition's, so they run on its SMs.
  That replays stay inside the partition is checked on the device by the
  isolation bench (scripts/gpu_check.py), not here.
- LoRA/delta variants: a variant's engine holds its own merged weights
  (weights/delta.py builds them), so it captures its own graphs, whose
  kernels read those weights' addresses; a variant never replays its base's
  graphs. Weights that change in place after capture would be read by the
  graphs as they are at replay (the same addresses), but layered loading
  changes which tensors exist: capture waits until every layer is in
  (`ModelRunner.capture_graphs` is called when the load completes).
- Preemption's swap streams: swap copies stay outside the graphs, on their
  own streams, ordered by CUDA events: the forward's stream waits for the
  gather of a swap-out before replaying (Swapper.execute records that wait on
  the current stream), so a replay never reads a block being copied out, and
  swap-ins complete before the step whose batch reads them.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from gpuservd.runner.llama import LayerCheckpoint

log = logging.getLogger(__name__)

ENV_SWITCH = "GPUSERV_CUDA_GRAPHS"


def disabled_by_env() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off")


def cuda_record(fn, pool):
    """Capture fn()'s kernels as one CUDA graph in `pool`; (replay, fn's outputs as static tensors)."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    return g.replay, out


class DecodeGraphs:
    """The captured graphs of one DecodeStep (a CUDA device), per bucket.

    record(fn, pool) -> (replay, outputs) captures; the default is CUDA's. Tests on a CPU pass a
    stand-in that re-runs fn and copies into the first outputs, to check everything around the
    capture (buckets, segments, yields, the static outputs read back) without a GPU."""

    def __init__(self, step, record=None):
        self.step = step
        self.cuda = record is None
        self.record = record or cuda_record
        self.pool = None  # the memory pool every graph of this engine shares
        self._whole: dict[int, tuple[object, torch.Tensor, torch.Tensor]] = {}  # replay, logits, chosen
        self._segments: dict[int, list[tuple[object, object]]] = {}  # replay, outputs; per layer
        # The device sampler after the forward, per (bucket, segmented): replay, chosen [2, bucket]. Its own
        # graph, replayed only when a row samples: an all-greedy step does not pay for its sort.
        self._sampler: dict[tuple[int, bool], tuple[object, torch.Tensor]] = {}
        self.capture_s = 0.0

    def has(self, bucket: int, segmented: bool = False) -> bool:
        return bucket in (self._segments if segmented else self._whole)

    @property
    def segmented(self) -> bool:
        return bool(self._segments)

    @property
    def captured(self) -> list[int]:
        return sorted(self._whole)

    def _reset_inputs(self) -> None:
        """Padding rows only: nothing written to the cache, nothing read from it."""
        self.step.inputs.neutral()

    def capture(self, sizes, segmented: bool = False) -> float:
        """Capture the buckets in `sizes` (largest first); returns the seconds it took."""
        t0 = time.perf_counter()
        model = self.step.model
        mid_layer, model.mid_layer = model.mid_layer, None  # a Python yield would run at capture only
        last_ids = self.step.last_ids.clone()  # the ids a step launched before the capture chose
        try:
            self._reset_inputs()
            self._warm_up(sizes)
            if self.pool is None and self.cuda:
                self.pool = torch.cuda.graph_pool_handle()
            for b in sorted(sizes, reverse=True):
                if segmented:
                    self._segments[b] = self._capture_segments(b)
                    logits = self._segments[b][-1][1][0]
                else:
                    self._whole[b] = self._capture_whole(b)
                    logits = self._whole[b][1]
                self._sampler[b, segmented] = self.record(lambda logits=logits: self.step.sample(logits), self.pool)
            if self.cuda:
                torch.cuda.synchronize()
        finally:
            model.mid_layer = mid_layer
            self.step.last_ids.copy_(last_ids)
        took = time.perf_counter() - t0
        self.capture_s += took
        return took

    def _warm_up(self, sizes) -> None:
        """One eager run per bucket off the graph (Triton compiles, cuBLAS picks, the allocator settles),
        on a side stream as capture requires."""
        if not self.cuda:
            for b in sizes:
                self.step.sample(self.step.forward(b))
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for b in sorted(sizes, reverse=True):
                self.step.sample(self.step.forward(b))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def _capture_whole(self, b: int):
        replay, (logits, chosen) = self.record(lambda: self.step.forward_and_choose(b), self.pool)
        return replay, logits, chosen

    def _capture_segments(self, b: int):
        """One graph per layer: [embed + layer 0], [layer 1], ..., [layer L-1 + LM head]; each segment
        resumes from the previous one's hidden states (a static tensor of the pool)."""
        step = self.step
        num_layers = step.model.arch.num_layers
        segments, ckpt = [], None
        for layer in range(num_layers):
            last = layer == num_layers - 1

            def segment(ckpt=ckpt, layer=layer, last=last):
                if ckpt is None:
                    step.resolve_ids(b)  # ids the previous step chose, gathered before the embedding
                out = step.model.forward(step.batch(b), step.cache.layer, resume=ckpt,
                                         suspend=None if last else (lambda i: i == layer))
                return (out, step.choose(out)) if last else out

            replay, out = self.record(segment, self.pool)
            if not last and not isinstance(out, LayerCheckpoint):
                raise RuntimeError(f"segment {layer} did not stop after its layer")
            segments.append((replay, out))
            ckpt = out
        return segments

    def replay(self, bucket: int, between=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay a bucket; (logits [bucket, V], chosen [2, bucket]: greedy ids, stop verdicts) in static
        buffers. With `between` (the arbiter's yield point) the per-layer segments replay with the
        yield in between (the caller checks has(bucket, segmented=True) first)."""
        if between is None:
            replay, logits, chosen = self._whole[bucket]
            replay()
            return logits, chosen
        segments = self._segments[bucket]
        for layer, (replay, _) in enumerate(segments):
            replay()
            if layer < len(segments) - 1:
                between(layer)
        return segments[-1][1]

    def replay_sampler(self, bucket: int, segmented: bool) -> torch.Tensor:
        """After replay(): every row's chosen id (drawn where it samples) and stop verdict, [2, bucket]."""
        replay, chosen = self._sampler[bucket, segmented]
        replay()
        return chosen

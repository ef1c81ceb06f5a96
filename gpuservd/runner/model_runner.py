"""Loads a model and its KV cache onto a device and runs forward passes on chunk lists."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpuservd.config import CudaGraphsConfig
from gpuservd.errors import UserError
from gpuservd.kv_cache.cache import KVCache, cache_shape
from gpuservd.runner import cuda_graphs
from gpuservd.runner.batch import SeqChunk, build_batch
from gpuservd.runner.decode_step import DecodeStep
from gpuservd.runner.linear import OutputBuffer
from gpuservd.runner.llama import LlamaModel
from gpuservd.runner.model_config import ModelArch, load_arch
from gpuservd.runner.load import load_weights

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadReport:
    """How a model load went."""

    model_dir: str
    weight_bytes: int  # in the compute dtype, on the device
    kv_cache_bytes: int
    num_kv_blocks: int
    load_s: float  # reading + converting the weights
    max_model_len: int


class ModelRunner:
    """A model and its paged KV cache on one device."""

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        device: str,
        block_size: int,
        kv_cache_bytes: int | None,
        device_memory_bytes: int,
        kv_cache_fraction: float,
        max_model_len: int | None,
        weight_source=None,
        initial_layers: int | None = None,
        on_layer=None,
        cuda_graphs_config: CudaGraphsConfig | None = None,
    ):
        """weight_source: a tensor source (the host tier's HostCopy, an INT8 file) instead of the
        store's safetensors, or an object whose build_weights(arch, dtype, device, initial_layers,
        on_layer) returns ready weights (weights/delta.py: shared base weights, alone or under a
        variant's delta); initial_layers: layered loading (see weights.load_weights)."""
        t0 = time.perf_counter()
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype]
        self.arch: ModelArch = load_arch(model_dir)
        limit = self.arch.max_position_embeddings
        if self.arch.sliding_window:
            # We attend over the full context; capping at the window keeps that exact.
            limit = min(limit, self.arch.sliding_window)
        self.max_model_len = min(limit, max_model_len) if max_model_len else limit
        if hasattr(weight_source, "build_weights"):  # weights shared with other engines (a base + delta)
            weights = weight_source.build_weights(self.arch, self.dtype, self.device, initial_layers=initial_layers,
                                                 on_layer=on_layer)
        else:
            weights = load_weights(weight_source if weight_source is not None else model_dir, self.arch, self.dtype,
                                   self.device, initial_layers=initial_layers, on_layer=on_layer)
        self.weights = weights
        self.model = LlamaModel(self.arch, weights, self.max_model_len, self.dtype, self.device)
        if self.device.type == "cpu":  # one logits buffer: execute()'s logits are valid until the next forward
            self.model.logits_out = OutputBuffer(weights.lm_head.out_features)
        self.block_size = block_size
        shape = cache_shape(self.arch, block_size, self.dtype)
        if kv_cache_bytes is None:
            kv_cache_bytes = int((device_memory_bytes - weights.nbytes()) * kv_cache_fraction)
        if kv_cache_bytes < shape.bytes_per_block:
            raise UserError(
                f"the KV cache budget ({kv_cache_bytes} bytes) holds no {shape.bytes_per_block}-byte block: "
                f"raise engine.device_memory_bytes (weights take {weights.nbytes()} bytes) or set engine.kv_cache_bytes"
            )
        self.cache = KVCache.from_budget(shape, kv_cache_bytes, self.device)
        self.load_report = LoadReport(
            model_dir=str(model_dir),
            weight_bytes=weights.nbytes(),
            kv_cache_bytes=self.cache.bytes,
            num_kv_blocks=self.cache.num_blocks,
            load_s=time.perf_counter() - t0,
            max_model_len=self.max_model_len,
        )
        self.decode_step: DecodeStep | None = None
        self._wants_segments = False  # an arbiter yields between layers (prepare_yields)
        self._graphs_config = cuda_graphs_config or CudaGraphsConfig()
        self._decode_reason = self._setup_decode_path()

    def _setup_decode_path(self) -> str:
        """Decide how decode-only steps run (the fixed-shape step, with or without graphs); returns why."""
        cfg = self._graphs_config
        kernels = self.model.kernels
        if self.device.type != "cuda":
            if cfg.enabled:
                log.warning("engine.cuda_graphs.enabled is true but engine.device is %s: CUDA graphs need a CUDA "
                            "device; decode steps run eagerly", self.device)
                return f"CUDA graphs asked for, but the device is {self.device}: eager"
            return f"eager on {self.device}"
        if cfg.enabled is False or cuda_graphs.disabled_by_env():
            why = "engine.cuda_graphs.enabled is false" if cfg.enabled is False else f"{cuda_graphs.ENV_SWITCH}=0"
            return f"eager ({why})"
        if kernels != "triton":
            log.warning("CUDA graphs not used: the Triton kernels are not (see the warning above); decode runs eagerly")
            return "eager: the Triton kernels are not available, and graphs need them"
        self.enable_decode_step(cfg.batch_sizes)
        self.decode_step.graphs = cuda_graphs.DecodeGraphs(self.decode_step)
        self._decode_reason = "CUDA graphs"
        gate = self.weights.gate
        if gate is None or gate.num_ready == self.arch.num_layers:
            self.capture_graphs()  # a failure sets the reason
        return self._decode_reason

    def enable_decode_step(self, batch_sizes) -> DecodeStep:
        """Run decode-only steps through the fixed-shape step (eagerly until graphs are captured)."""
        if self.model.kernels is None:
            raise UserError("the fixed-shape decode step needs the fused kernels (C++ on the CPU, Triton on CUDA)")
        self.decode_step = DecodeStep(self.model, self.cache, self.block_size, self.max_model_len, batch_sizes)
        return self.decode_step

    def capture_graphs(self, segmented: bool = False) -> None:
        """Capture every bucket's graph (all layers must be loaded); one log line with the time it took."""
        g = self.decode_step.graphs
        sizes = self.decode_step.batch_sizes
        try:
            took = g.capture(sizes, segmented=segmented)
        except Exception as e:  # noqa: BLE001 - a failed capture means: run eagerly, and say so
            line = str(e).strip().splitlines()
            self._decode_reason = f"eager: CUDA graph capture failed ({type(e).__name__}: {line[-1] if line else ''})"
            log.warning("%s; decode steps run the fixed-shape step eagerly", self._decode_reason)
            self.decode_step.graphs = None
            return
        log.info("captured %s CUDA graphs of the decode step for batch sizes %s in %.2f s",
                 "per-layer" if segmented else "whole-forward", ",".join(map(str, sizes)), took)

    def prepare_yields(self) -> None:
        """The sharing arbiter will yield between layers: capture per-layer segment graphs (once; after a
        layered load, when the whole-forward graphs are captured)."""
        self._wants_segments = True
        step = self.decode_step
        if step is not None and step.graphs is not None and not step.graphs.segmented and step.graphs.captured:
            self.capture_graphs(segmented=True)

    def decode_status(self) -> dict:
        """How decode steps run, for /admin/status and `gpuserv doctor`."""
        step = self.decode_step
        graphs = step.graphs if step is not None else None
        captured = graphs.captured if graphs is not None else []
        path = "cuda_graphs" if captured else ("fixed_shape_eager" if step is not None else "eager")
        return {"path": path, "reason": self._decode_reason, "kernels": self.model.kernels or "torch",
                "batch_sizes": list(step.batch_sizes) if step is not None else [],
                "captured": captured, "segmented": bool(graphs is not None and graphs.segmented),
                "capture_s": round(graphs.capture_s, 3) if graphs is not None else None,
                "last_step": step.last_path if step is not None else "eager"}

    def execute(self, chunks: list[SeqChunk], suspend=None, sources=None):
        """One forward over the chunks; logits [S, V] (fp32; on the CPU valid until the next forward) for
        the chunks with sample=True, in order, or a LayerCheckpoint if suspend(layer) asked to stop between
        layers (see resume()). Decode-only steps go through the fixed-shape step where it is on, which
        returns a DecodeResult; sources[i] >= 0 there: chunk i's token is the one the previous step chose in
        that row, not read yet."""
        step = self.decode_step
        if step is not None and step.takes(chunks):
            graphs = step.graphs
            gate = self.weights.gate
            if graphs is not None and not graphs.captured and (gate is None or gate.num_ready == self.arch.num_layers):
                self.capture_graphs()  # a layered load has completed
                if self._wants_segments and step.graphs is not None:
                    self.capture_graphs(segmented=True)
            return step.run(chunks, between=suspend, sources=sources)
        if sources is not None and any(i >= 0 for i in sources):
            raise ValueError("tokens still on the device can only feed the fixed-shape decode step")
        batch = build_batch(chunks, self.block_size, self.device)
        return self.model.forward(batch, self.cache.layer, suspend=suspend)

    def resume(self, checkpoint, between=None) -> torch.Tensor:
        """Finish a suspended forward; logits as execute() would have returned them. between(layer)
        is called after each layer (it may block: the sharing arbiter) and must return False."""
        return self.model.forward(checkpoint.batch, self.cache.layer, suspend=between, resume=checkpoint)

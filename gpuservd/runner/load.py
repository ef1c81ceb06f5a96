"""The per-layer loader: safetensors (or any tensor source) into the runner's layout (model_weights.py).

A layered load returns once the first layers are in and brings the rest in on a
background thread, so prefill can start before the whole model has arrived; the
runner waits per layer (LayerGate).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open

from gpuservd.errors import StoreCorrupt
from gpuservd.runner.linear import Linear, onednn_available
from gpuservd.runner.model_config import ModelArch
from gpuservd.runner.model_weights import LayerGate, LayerWeights, ModelWeights
from gpuservd.runner.qtensor import QTensor
from gpuservd.store.readahead import FileReadahead


class SafetensorsReader:
    """Finds each tensor name in a model directory's shards and reads it on demand."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        index = self.model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise StoreCorrupt(f"{index}: unreadable shard index ({exc})") from None
            shards = sorted(set(weight_map.values()))
        else:
            shards = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
            if not shards:
                raise StoreCorrupt(f"{self.model_dir}: no *.safetensors weight file")
        self._handles = {}
        self.name_to_shard: dict[str, str] = {}
        for shard in shards:
            path = self.model_dir / shard
            if not path.exists():
                raise StoreCorrupt(f"{path}: weight shard missing")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error types
                raise StoreCorrupt(f"{path}: unreadable safetensors file ({exc})") from None
            self._handles[shard] = handle
            for name in handle.keys():
                self.name_to_shard[name] = shard

        self._readahead: dict[str, FileReadahead] = {}  # per shard, made on the first prefetch

    def has(self, name: str) -> bool:
        return name in self.name_to_shard

    def prefetch(self, names) -> None:
        """Start reading these tensors' bytes from the disk in the background (store/readahead.py)."""
        by_shard: dict[str, list[str]] = {}
        for name in names:
            if name in self.name_to_shard:
                by_shard.setdefault(self.name_to_shard[name], []).append(name)
        for shard, group in by_shard.items():
            if shard not in self._readahead:
                self._readahead[shard] = FileReadahead(self.model_dir / shard)
            self._readahead[shard].ask(group)

    def names(self) -> list[str]:
        return sorted(self.name_to_shard)

    def shape(self, name: str) -> list[int]:
        return list(self._handles[self.name_to_shard[name]].get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        shard = self.name_to_shard.get(name)
        if shard is None:
            raise StoreCorrupt(f"{self.model_dir}: tensor {name!r} is in no weight file")
        return self._handles[shard].get_tensor(name)


def _cast(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).contiguous()


class Upload:
    """How one load's tensors reach the device.

    CPU (the device tier is RAM): read, concatenate, cast. CUDA: each tensor is gathered into pinned
    host memory and copied on a side stream, so the copies run beside the forward of a layered
    load's first layers; a source that holds INT8 (`get_stored` returns a QTensor: the INT8 file,
    a compressed host copy) sends its int8 bytes and scales, and they are expanded to the compute
    dtype on the GPU (a quarter of fp32's bytes cross the link). Outputs are allocated on the
    caller's stream, so the compute stream owns their memory. `wait()` returns once every copy
    enqueued so far has landed; a layer is marked ready only after it."""

    def __init__(self, reader, device: torch.device):
        self.reader = reader
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._held: list[torch.Tensor] = []  # pinned sources of copies in flight

    def tensor(self, names, dtype: torch.dtype) -> torch.Tensor:
        """The named tensors, concatenated along dim 0 (fused q/k/v, gate/up), on the device in dtype."""
        names = [names] if isinstance(names, str) else list(names)
        stored = getattr(self.reader, "get_stored", self.reader.get)
        parts = [stored(n) for n in names]
        if not self.cuda:  # INT8 expanded straight into the compute dtype
            parts = [p.dequantize(dtype) if isinstance(p, QTensor) else p for p in parts]
            return _cast(parts[0] if len(parts) == 1 else torch.cat(parts), dtype, self.device)
        if all(isinstance(p, QTensor) for p in parts) and len({(p.group_size, p.minimum is None) for p in parts}) == 1:
            q, scale = self._send([p.q for p in parts]), self._send([p.scale for p in parts])
            low = None if parts[0].minimum is None else self._send([p.minimum for p in parts])
            out = torch.empty(q.shape, dtype=dtype, device=self.device)
            with torch.cuda.stream(self.stream):  # the CPU's expansion, run on the GPU's copy of the bytes
                QTensor(q, scale, parts[0].group_size, low).dequantize(dtype, out=out)
            return out
        parts = [p.dequantize(torch.float32) if isinstance(p, QTensor) else p for p in parts]
        src = self._pinned(parts)
        out = torch.empty(src.shape, dtype=dtype, device=self.device)
        with torch.cuda.stream(self.stream):
            out.copy_(src, non_blocking=True)
        return out

    def _pinned(self, parts: list[torch.Tensor]) -> torch.Tensor:
        shape = (sum(p.shape[0] for p in parts),) + tuple(parts[0].shape[1:])
        buf = torch.empty(shape, dtype=parts[0].dtype, pin_memory=True)
        torch.cat(parts, out=buf) if len(parts) > 1 else buf.copy_(parts[0])
        self._held.append(buf)
        return buf

    def _send(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Raw bytes to the device on the side stream (an intermediate of the side stream's own)."""
        src = self._pinned(parts)
        with torch.cuda.stream(self.stream):
            return src.to(self.device, non_blocking=True)

    def wait(self) -> None:
        if self.cuda:
            self.stream.synchronize()
            self._held.clear()


def load_layer(up: Upload, arch: ModelArch, i: int, dtype, onednn: bool) -> LayerWeights:
    """Read and fuse one decoder layer (its copies may still be in flight on CUDA: `up.wait()`)."""
    p = f"model.layers.{i}."

    def lin(*names: str, bias: tuple[str, ...] = ()) -> Linear:
        w = up.tensor([p + n for n in names], dtype)
        b = up.tensor([p + n for n in bias], dtype) if bias else None
        return Linear(w, b, onednn)

    qkv_names = tuple(f"self_attn.{n}_proj.weight" for n in "qkv")
    qkv_bias = tuple(f"self_attn.{n}_proj.bias" for n in "qkv") if arch.qkv_bias else ()
    return LayerWeights(
        input_norm=up.tensor(p + "input_layernorm.weight", dtype),
        qkv=lin(*qkv_names, bias=qkv_bias),
        o_proj=lin("self_attn.o_proj.weight"),
        post_norm=up.tensor(p + "post_attention_layernorm.weight", dtype),
        gate_up=lin("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        down=lin("mlp.down_proj.weight"),
    )


def expected_bytes(source, dtype: torch.dtype) -> int:
    """Parameter bytes of a model in the compute dtype, from its tensor shapes (nothing loaded)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for name in source.names():
        n = 1
        for d in source.shape(name):
            n *= d
        total += n * elem
    return total


READ_AHEAD_LAYERS = 2  # layers whose bytes are asked for ahead of the one being loaded


def load_weights(
    source, arch: ModelArch, dtype: torch.dtype, device: torch.device, onednn: bool | None = None,
    initial_layers: int | None = None, on_layer=None,
) -> ModelWeights:
    """Load a model into the runner's layout from a model directory or a tensor source (get / has).

    initial_layers=k (layered loading: prefill starts before the whole model is in): return once
    layers [0, k) are in; the others load on a background thread, and the runner waits per layer
    (ModelWeights.layer). on_layer(i, seconds) is called as each layer lands (progress for status
    and events)."""
    if onednn is None:
        onednn = onednn_available(device, dtype)
    reader = SafetensorsReader(source) if isinstance(source, (str, Path)) else source
    up = Upload(reader, device)
    n = arch.num_layers
    prefetch = getattr(reader, "prefetch", None)  # a file-backed source: read ahead of the loader
    by_layer: list[list[str]] = [[] for _ in range(n)]
    if prefetch is not None:
        others = []
        for name in reader.names():
            parts = name.split(".")
            if name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) < n:
                by_layer[int(parts[2])].append(name)
            else:
                others.append(name)
        prefetch(others + by_layer[0] + (by_layer[1] if n > 1 else []))
    embed = up.tensor("model.embed_tokens.weight", dtype)
    tied = not (reader.has("lm_head.weight") and not arch.tie_word_embeddings)
    if not tied:
        lm_head = Linear(up.tensor("lm_head.weight", dtype), None, onednn)
    else:
        lm_head = Linear(embed, None, onednn)
        if lm_head.packed is not None:
            embed = None  # one copy: the packed head; embedding rows are read out of it
    final_norm = up.tensor("model.norm.weight", dtype)
    up.wait()

    def load(i: int) -> LayerWeights:
        t0 = time.perf_counter()
        if prefetch is not None and i + READ_AHEAD_LAYERS < n:
            prefetch(by_layer[i + READ_AHEAD_LAYERS])
        lw = load_layer(up, arch, i, dtype, onednn)
        up.wait()
        if on_layer is not None:
            on_layer(i, time.perf_counter() - t0)
        return lw

    if initial_layers is None or initial_layers >= n:
        return ModelWeights(embed, final_norm, lm_head, [load(i) for i in range(n)], tied=tied)
    layers: list[LayerWeights | None] = [None] * n
    gate = LayerGate(n)
    for i in range(max(0, initial_layers)):
        layers[i] = load(i)
        gate.set(i)

    def rest():
        try:
            for i in range(max(0, initial_layers), n):
                layers[i] = load(i)
                gate.set(i)
        except BaseException as exc:  # the runner raises it where it waits for the layer
            gate.fail(exc)

    weights = ModelWeights(embed, final_norm, lm_head, layers, gate, expected_bytes(reader, dtype), tied=tied)
    threading.Thread(target=rest, name="layered-load", daemon=True).start()
    return weights

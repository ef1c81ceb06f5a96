"""The per-layer loader: safetensors (or any tensor source) into the runner's layout (model_weights.py).

A layered load returns once the first layers are in and brings the rest in on a
background thread, so prefill can start before the whole model has arrived; the
runner waits per layer (LayerGate).

A source that reads from the disk (`read_group`: the store's safetensors, the INT8 file) is read
on a reader thread of its own, groups of tensors in load order, ahead of the loader
(pipeline.py): the disk reads layer i+1 while the loader expands (INT8), casts and copies layer i
to the device and, in a layered load, while the forward runs the layers already in.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors import safe_open

from gpuservd.errors import StoreCorrupt
from gpuservd.runner import panel_arena
from gpuservd.runner.linear import Linear, onednn_available, packed_enabled
from gpuservd.runner.panel_arena import PanelArena
from gpuservd.runner.model_config import ModelArch
from gpuservd.runner.model_weights import LayerGate, LayerWeights, ModelWeights
from gpuservd.runner.pipeline import GroupReader
from gpuservd.runner.qtensor import QTensor
from gpuservd.store.readahead import FileReadahead
from gpuservd.store.tensor_file import TensorFile


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
        self._files: dict[str, TensorFile] = {}  # per shard, made on the first read_group

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
        return self._handles[self._shard(name)].get_tensor(name)

    def _shard(self, name: str) -> str:
        shard = self.name_to_shard.get(name)
        if shard is None:
            raise StoreCorrupt(f"{self.model_dir}: tensor {name!r} is in no weight file")
        return shard

    def _file(self, shard: str) -> TensorFile:
        if shard not in self._files:
            self._files[shard] = TensorFile(self.model_dir / shard)
        return self._files[shard]

    def read_group(self, names, pin: bool = False) -> list[torch.Tensor]:
        """The named tensors read from the disk into fresh (pinned when asked) memory, as parts whose
        concatenation by rows is what the loader places: one tensor when they lie in one shard
        (read straight into it), else one per name. Positioned reads: the GIL is free meanwhile."""
        shards = {self._shard(n) for n in names}
        if len(shards) == 1:
            f = self._file(shards.pop())
            return [f.read_rows(names, pin) if len(names) > 1 else f.read(names[0], pin)]
        return [self._file(self._shard(n)).read(n, pin) for n in names]

    @property
    def bytes_read(self) -> int:
        """Bytes read by read_group so far (the memory-mapped get() is not counted)."""
        return sum(f.bytes_read for f in self._files.values())


def _cast(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=dtype).contiguous()


class Upload:
    """How one load's tensors reach the device.

    CPU (the device tier is RAM): read, expand or cast, each part straight into its rows of the fused
    tensor. CUDA: each tensor is gathered into pinned host memory (a pipelined read lands there
    already) and copied on a side stream, so the copies run beside the forward of a layered load's
    first layers; a source that holds INT8 (`get_stored` returns a QTensor: the INT8 file, a
    compressed host copy) sends its int8 bytes and scales, and they are expanded to the compute
    dtype on the GPU (a quarter of fp32's bytes cross the link). Outputs are allocated on the
    caller's stream, so the compute stream owns their memory. `wait()` returns once every copy
    enqueued so far has landed; a layer is marked ready only after it.

    `ready` holds parts a reader thread has already read (pipeline.py), keyed by their names; a
    tensor not there is read now, through the source's get_stored / get."""

    def __init__(self, reader, device: torch.device):
        self.reader = reader
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._held: list[torch.Tensor] = []  # pinned sources of copies in flight
        self.ready: dict[tuple[str, ...], list] = {}

    def tensor(self, names, dtype: torch.dtype) -> torch.Tensor:
        """The named tensors, concatenated along dim 0 (fused q/k/v, gate/up), on the device in dtype."""
        names = (names,) if isinstance(names, str) else tuple(names)
        parts = self.ready.pop(names, None)
        if parts is None:
            stored = getattr(self.reader, "get_stored", self.reader.get)
            parts = [stored(n) for n in names]
        if not self.cuda:
            return _place_cpu(parts, dtype, self.device)
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
        if len(parts) == 1 and parts[0].is_pinned() and parts[0].is_contiguous():
            buf = parts[0]  # read into pinned memory by the reader thread: no second copy
        else:
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


def _place_cpu(parts: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Parts (tensors or QTensors) concatenated by rows in dtype: each part expanded or cast straight
    into its rows (one pass; INT8 expanded into the compute dtype without an fp32 intermediate)."""
    if len(parts) == 1 and not isinstance(parts[0], QTensor):
        return _cast(parts[0], dtype, device)
    shapes = [p.q.shape if isinstance(p, QTensor) else p.shape for p in parts]
    out = torch.empty((sum(s[0] for s in shapes),) + tuple(shapes[0][1:]), dtype=dtype, device=device)
    row = 0
    for p, shape in zip(parts, shapes):
        rows = out[row:row + shape[0]]
        p.dequantize(dtype, out=rows) if isinstance(p, QTensor) else rows.copy_(p)
        row += shape[0]
    return out


def layer_groups(arch: ModelArch, i: int) -> dict[str, tuple[str, ...]]:
    """Decoder layer i's placed tensors: {what: the checkpoint names fused into it, by rows}."""
    p = f"model.layers.{i}."
    groups = {
        "input_norm": (p + "input_layernorm.weight",),
        "qkv": tuple(f"{p}self_attn.{n}_proj.weight" for n in "qkv"),
        "o_proj": (p + "self_attn.o_proj.weight",),
        "post_norm": (p + "post_attention_layernorm.weight",),
        "gate_up": (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
        "down": (p + "mlp.down_proj.weight",),
    }
    if arch.qkv_bias:
        groups["qkv_bias"] = tuple(f"{p}self_attn.{n}_proj.bias" for n in "qkv")
    return groups


def outside_groups(reader, arch: ModelArch) -> tuple[dict[str, tuple[str, ...]], bool]:
    """({what: names} of the tensors outside the layers, whether the LM head is the embedding)."""
    tied = not (reader.has("lm_head.weight") and not arch.tie_word_embeddings)
    groups = {"embed": ("model.embed_tokens.weight",), "final_norm": ("model.norm.weight",)}
    if not tied:
        groups["lm_head"] = ("lm_head.weight",)
    return groups, tied


def load_layer(up: Upload, arch: ModelArch, i: int, dtype, onednn: bool,
               arena: PanelArena | None = None) -> LayerWeights:
    """Read and fuse one decoder layer (its copies may still be in flight on CUDA: `up.wait()`). arena:
    where its packed weights go (the load's shared huge-page blocks)."""
    g = layer_groups(arch, i)
    bias = up.tensor(g["qkv_bias"], dtype) if "qkv_bias" in g else None
    return LayerWeights(
        input_norm=up.tensor(g["input_norm"], dtype),
        qkv=Linear(up.tensor(g["qkv"], dtype), bias, onednn, arena=arena),
        o_proj=Linear(up.tensor(g["o_proj"], dtype), None, onednn, arena=arena),
        post_norm=up.tensor(g["post_norm"], dtype),
        gate_up=Linear(up.tensor(g["gate_up"], dtype), None, onednn, arena=arena),
        down=Linear(up.tensor(g["down"], dtype), None, onednn, arena=arena),
    )


def layer_panel_bytes(source, arch: ModelArch, dtype: torch.dtype) -> int:
    """What the layers' packed weights take in a load's arena (panel_arena.py), from the tensor shapes; an
    upper bound (fp32 panels of a bf16-exact weight come out half this)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    total = 0
    for i in range(arch.num_layers):
        for what, names in layer_groups(arch, i).items():
            if what in ("qkv", "o_proj", "gate_up", "down"):
                total += panel_arena.panel_bytes(sum(source.shape(n)[0] for n in names), source.shape(names[0])[1], elem)
    return total


def _layer_arena(reader, arch: ModelArch, dtype: torch.dtype, device: torch.device) -> PanelArena | None:
    """Where a CPU load puts its layers' packed weights: side by side on 2 MB pages (panel_arena.py). The
    LM head, large enough to be on them in a mapping of its own, stays out. Only the load's closures hold
    the arena: when the load ends it goes, and its blocks live as long as the tensors cut from them."""
    if device.type != "cpu" or not packed_enabled(device, dtype):
        return None
    try:  # a source without shapes (or missing a tensor, which the load then reports) reserves nothing
        reserve = layer_panel_bytes(reader, arch, dtype) if hasattr(reader, "shape") else 0
    except (KeyError, IndexError):
        reserve = 0
    return panel_arena.for_load(reserve)


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


READ_AHEAD_LAYERS = 2  # layers whose bytes are asked for ahead of the one being loaded (no reader thread)
PIPELINE_SWITCH = "GPUSERV_LOAD_PIPELINE"  # =0: no reader thread (the A/B reference for the cold-start bench)


def pipeline_enabled() -> bool:
    return os.environ.get(PIPELINE_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def _layer_names(reader, n: int) -> tuple[list[list[str]], list[str]]:
    """(each layer's tensor names, the names outside the layers) of a source."""
    by_layer: list[list[str]] = [[] for _ in range(n)]
    others = []
    for name in reader.names():
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) < n:
            by_layer[int(parts[2])].append(name)
        else:
            others.append(name)
    return by_layer, others


def _group_reader(reader, arch: ModelArch, outside: dict, device: torch.device) -> GroupReader:
    """The reader thread of a load: what lies outside the layers, then each layer, in load order."""
    groups = [list(outside.values())] + [list(layer_groups(arch, i).values()) for i in range(arch.num_layers)]
    pin_device = None
    if device.type == "cuda":  # the loading thread's current device when the load names none ("cuda")
        pin_device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    return GroupReader(reader, groups, pin_device=pin_device)


def _load_outside(up: Upload, outside: dict, tied: bool, dtype, onednn: bool):
    """(embedding or None, LM head, final norm), landed on the device."""
    embed = up.tensor(outside["embed"], dtype)
    if not tied:
        lm_head = Linear(up.tensor(outside["lm_head"], dtype), None, onednn)
    else:
        lm_head = Linear(embed, None, onednn)
        if lm_head.packed is not None:
            embed = None  # one copy: the packed head; embedding rows are read out of it
    final_norm = up.tensor(outside["final_norm"], dtype)
    up.wait()
    return embed, lm_head, final_norm


def return_freed_memory(device: torch.device) -> None:
    """Hand the heap pages a CPU load freed back to the OS. The packed layouts are built from a dense
    copy dropped once packed, and glibc keeps such freed pages in its heap: after a SmolLM2 fp32 load
    the process held ~200 MB above its weights (RSS 942 MB, 740 after this), as if they were loaded twice."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl): no such call, nothing kept to give back
        pass


def load_weights(
    source, arch: ModelArch, dtype: torch.dtype, device: torch.device, onednn: bool | None = None,
    initial_layers: int | None = None, on_layer=None, pipeline: bool | None = None,
) -> ModelWeights:
    """Load a model into the runner's layout from a model directory or a tensor source (get / has).

    initial_layers=k (layered loading: prefill starts before the whole model is in): return once
    layers [0, k) are in; the others load on a background thread, and the runner waits per layer
    (ModelWeights.layer). on_layer(i, seconds) is called as each layer lands (progress for status
    and events). pipeline: a source that reads from the disk (read_group) is read on a reader thread
    ahead of the loader (pipeline.py); False reads each tensor where it is placed (the reference the
    tests compare the pipeline with); None: on unless GPUSERV_LOAD_PIPELINE=0."""
    onednn = onednn_available(device, dtype) if onednn is None else onednn
    reader = SafetensorsReader(source) if isinstance(source, (str, Path)) else source
    up = Upload(reader, device)
    n = arch.num_layers
    outside, tied = outside_groups(reader, arch)
    reads: GroupReader | None = None
    prefetch = getattr(reader, "prefetch", None)  # a file-backed source: read ahead of the loader
    if pipeline is None:
        pipeline = pipeline_enabled()
    if pipeline and hasattr(reader, "read_group"):
        reads = _group_reader(reader, arch, outside, device)
        prefetch = None  # the reader thread asks for each group's bytes ahead of its own reads
    arena = _layer_arena(reader, arch, dtype, device)
    by_layer: list[list[str]] = []
    if prefetch is not None:
        by_layer, others = _layer_names(reader, n)
        prefetch(others + by_layer[0] + (by_layer[1] if n > 1 else []))

    def take() -> None:
        if reads is not None:
            up.ready = reads.take()

    def load(i: int) -> LayerWeights:
        t0 = time.perf_counter()
        if prefetch is not None and i + READ_AHEAD_LAYERS < n:
            prefetch(by_layer[i + READ_AHEAD_LAYERS])
        take()
        lw = load_layer(up, arch, i, dtype, onednn, arena)
        up.wait()
        if on_layer is not None:
            on_layer(i, time.perf_counter() - t0)
        return lw

    try:
        take()
        embed, lm_head, final_norm = _load_outside(up, outside, tied, dtype, onednn)
        if initial_layers is None or initial_layers >= n:
            full = ModelWeights(embed, final_norm, lm_head, [load(i) for i in range(n)], tied=tied)
            if reads is not None:
                reads.close()  # it has ended: every group was taken
            return_freed_memory(device)
            return full
        layers: list[LayerWeights | None] = [None] * n
        gate = LayerGate(n)
        for i in range(max(0, initial_layers)):
            layers[i] = load(i)
            gate.set(i)
    except BaseException:
        if reads is not None:
            reads.close()
        raise

    def rest():
        try:
            for i in range(max(0, initial_layers), n):
                layers[i] = load(i)
                gate.set(i)
            return_freed_memory(device)
        except BaseException as exc:  # the runner raises it where it waits for the layer
            gate.fail(exc)
        finally:
            if reads is not None:
                reads.close()
            up.ready = {}

    weights = ModelWeights(embed, final_norm, lm_head, layers, gate, expected_bytes(reader, dtype), tied=tied)
    threading.Thread(target=rest, name="layered-load", daemon=True).start()
    return weights

"""The pipelined load (runner/pipeline.py): a reader thread reads layers ahead of the loader.

It must place exactly the bytes the one-tensor-at-a-time path places (fp32, a cast, INT8), surface a
reader's failure as a load error without leaving a thread or a read tensor behind, never hang when
the loader stops first, and really read ahead while the loader works on a layer."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from factories import make_model_dir
from safetensors.torch import save_file

from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.errors import StoreCorrupt
from gpuservd.runner.load import SafetensorsReader, load_weights
from gpuservd.runner.model_config import load_arch
from gpuservd.store.tensor_file import TensorFile
from gpuservd.weights.int8_file import Int8Reader, int8_path, write_int8

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Six layers (room to read ahead) of a Qwen2-shaped model (q/k/v biases: one more fused group)."""
    d = tmp_path_factory.mktemp("pipeline-model")
    make_model_dir(d, "qwen2", num_hidden_layers=6, tie_word_embeddings=False)
    write_int8(SafetensorsReader(d), d)
    return d


def _tensors(w) -> dict[str, torch.Tensor]:
    """Every placed tensor of a ModelWeights, by a name (all layers waited for)."""
    out = {"final_norm": w.final_norm, "lm_head": w.lm_head.packed if w.lm_head.weight is None else w.lm_head.weight}
    if w.embed is not None:
        out["embed"] = w.embed
    for i in range(len(w.layers)):
        lw = w.layer(i)
        out[f"{i}.input_norm"], out[f"{i}.post_norm"] = lw.input_norm, lw.post_norm
        for name in ("qkv", "o_proj", "gate_up", "down"):
            lin = getattr(lw, name)
            out[f"{i}.{name}"] = lin.packed if lin.weight is None else lin.weight
            if lin.bias is not None:
                out[f"{i}.{name}.bias"] = lin.bias
    return out


def _assert_identical(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k


def _no_reader_left() -> bool:
    for t in threading.enumerate():
        if t.name == "weight-reader":
            t.join(5)
    return not any(t.name == "weight-reader" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("initial_layers", [None, 2])
def test_pipelined_fp_load_is_bit_identical_to_the_sequential_one(model, dtype, initial_layers):
    arch = load_arch(model)
    seq = load_weights(SafetensorsReader(model), arch, dtype, CPU, pipeline=False)
    reader = SafetensorsReader(model)
    piped = load_weights(reader, arch, dtype, CPU, initial_layers=initial_layers)
    _assert_identical(piped, seq)
    # every weight byte came through the reader thread's positioned reads, once
    assert reader.bytes_read == sum(TensorFile(model / "model.safetensors").entries[k].end
                                    - TensorFile(model / "model.safetensors").entries[k].start
                                    for k in reader.names())
    assert _no_reader_left()


@pytest.mark.parametrize("initial_layers", [None, 1])
def test_pipelined_int8_load_is_bit_identical_and_reads_the_int8_bytes(model, initial_layers):
    arch = load_arch(model)
    seq = load_weights(Int8Reader(int8_path(model)), arch, torch.float32, CPU, pipeline=False)
    reader = Int8Reader(int8_path(model))
    piped = load_weights(reader, arch, torch.float32, CPU, initial_layers=initial_layers)
    _assert_identical(piped, seq)
    assert reader._file.bytes_read == reader.bytes_read  # every byte through the positioned reads
    assert 0 < reader.bytes_read < 0.4 * (model / "model.safetensors").stat().st_size
    assert _no_reader_left()


class Failing:
    """A source whose reads fail at one layer (an I/O error), keeping a weak reference to each part read."""

    def __init__(self, inner, layer: int):
        self.inner, self.layer, self.parts = inner, layer, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def read_group(self, names, pin=False):
        if any(n.startswith(f"model.layers.{self.layer}.") for n in names):
            raise OSError(5, "Input/output error", "model.safetensors")
        parts = self.inner.read_group(names, pin)
        self.parts += [weakref.ref(p) for p in parts]
        return parts


def test_a_reader_error_is_a_clean_load_error(model):
    """The I/O error of the reader thread is the load's StoreCorrupt; no reader thread stays, and no tensor
    it read is still held by anything."""
    source = Failing(SafetensorsReader(model), layer=3)
    with pytest.raises(StoreCorrupt, match="reading the weights failed: OSError.*Input/output error"):
        load_weights(source, load_arch(model), torch.float32, CPU)
    assert _no_reader_left()
    gc.collect()
    assert source.parts and all(r() is None for r in source.parts)


def test_a_reader_error_in_a_layered_load_surfaces_at_its_layer(model):
    source = Failing(SafetensorsReader(model), layer=4)
    w = load_weights(source, load_arch(model), torch.float32, CPU, initial_layers=2)
    w.layer(3)
    with pytest.raises(StoreCorrupt, match="layer 4 could not be loaded: reading the weights failed"):
        w.layer(4)
    assert _no_reader_left()


def test_a_loader_that_stops_first_does_not_leave_the_reader_waiting(model):
    """The loader fails at layer 0 (its callback raises) while the reader is blocked on a full queue:
    the load raises the loader's error and the reader ends."""
    def boom(i, seconds):
        raise RuntimeError("loader stopped")

    with pytest.raises(RuntimeError, match="loader stopped"):
        load_weights(SafetensorsReader(model), load_arch(model), torch.float32, CPU, on_layer=boom)
    assert _no_reader_left()


def test_the_reader_reads_ahead_while_the_loader_places_a_layer(model):
    """While the loader is inside layer 0 (its on_layer callback), the reader reads layers 1 and 2: the
    callback waits for those reads, which a load that reads where it places would never do."""
    read = {i: threading.Event() for i in range(6)}

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def read_group(self, names, pin=False):
            parts = self.inner.read_group(names, pin)
            if names[0].startswith("model.layers."):
                read[int(names[0].split(".")[2])].set()
            return parts

    ahead = []

    def on_layer(i, seconds):
        if i == 0:
            ahead.append(read[1].wait(30) and read[2].wait(30))

    load_weights(Recording(SafetensorsReader(model)), load_arch(model), torch.float32, CPU, on_layer=on_layer)
    assert ahead == [True]


def test_layered_pipelined_engine_serves_a_first_token(model):
    """A layered load through the pipeline serves the same greedy tokens as a full sequential one."""
    params = SamplingParams(max_tokens=6, ignore_eos=True, detokenize=False)
    cfg = EngineConfig(model="m", dtype="float32", kv_cache_bytes=4 << 20, block_size=4)
    ref = LLMEngine("m", model, cfg, weight_source=SafetensorsReader(model))
    eng = LLMEngine("m", model, cfg, weight_source=SafetensorsReader(model), initial_layers=1,
                    tokenizer=ref.tokenizer)
    prompts = [[5, 17, 99, 3, 250, 41], [7] * 9]
    assert eng.generate(prompts, params) == ref.generate(prompts, params)


def test_tensor_file_reads_rows_and_refuses_a_truncated_file(tmp_path):
    a, b, c = torch.randn(3, 4), torch.randn(5, 4), torch.arange(7, dtype=torch.int8)
    path = tmp_path / "t.safetensors"
    save_file({"a": a, "b": b, "c": c}, str(path))
    f = TensorFile(path)
    assert torch.equal(f.read_rows(["a", "b"]), torch.cat([a, b]))
    assert torch.equal(f.read_rows(["b", "a"]), torch.cat([b, a]))  # not in file order: a preadv each
    assert torch.equal(f.read("c"), c)
    assert f.bytes_read == 2 * (a.numel() + b.numel()) * 4 + 7
    with pytest.raises(StoreCorrupt, match="cannot be stacked"):
        f.read_rows(["a", "c"])
    last = max(f.entries, key=lambda k: f.entries[k].end)
    with open(path, "r+b") as fh:
        fh.truncate(f.entries[last].end - 3)
    with pytest.raises(StoreCorrupt, match="truncated"):
        TensorFile(path).read(last)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("int8", [False, True])
def test_pipelined_load_on_cuda_is_bit_identical(model, dtype, int8):
    """On CUDA the reader thread reads into pinned memory that is copied (INT8: then expanded) on the side
    stream: the device weights equal those of the sequential path, for fp32 and bf16, layered too."""
    arch, dev = load_arch(model), torch.device("cuda:0")

    def source():
        return Int8Reader(int8_path(model)) if int8 else SafetensorsReader(model)

    seq = load_weights(source(), arch, dtype, dev, pipeline=False)
    _assert_identical(load_weights(source(), arch, dtype, dev), seq)
    _assert_identical(load_weights(source(), arch, dtype, dev, initial_layers=2), seq)
    assert _no_reader_left()


def test_a_counting_wrapper_counts_what_the_reader_thread_reads(model):
    """weights/delta.py's CountingSource (the variant-load bench's byte count) sees the pipelined reads."""
    from gpuservd.weights.delta import CountingSource

    inner = SafetensorsReader(model)
    counted = CountingSource(inner)
    load_weights(counted, load_arch(model), torch.float32, CPU)
    assert counted.bytes_read == inner.bytes_read > 0

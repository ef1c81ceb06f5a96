"""Weight tiers on a tiny model: layered loading, the host tier, INT8 in RAM and on disk."""

from __future__ import annotations

import time

import pytest
import torch

from gpuservd.config import EngineConfig
from gpuservd.engine.engine import LLMEngine
from gpuservd.engine.request import SamplingParams
from gpuservd.errors import StoreCorrupt
from gpuservd.runner.load import SafetensorsReader
from gpuservd.weights.host_tier import HostCopy
from gpuservd.weights.int8_file import Int8Reader, int8_path, write_int8
from gpuservd.weights.quant import quantize_int8

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, detokenize=False)
PROMPTS = [[5, 17, 99, 3, 250, 41], [7] * 20]


def engine(model_dir, **kw) -> LLMEngine:
    return LLMEngine("tiny", model_dir, EngineConfig(model="tiny", dtype="float32", kv_cache_bytes=4 << 20, block_size=4), **kw)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return engine(tiny_model_dir).generate(PROMPTS, PARAMS)


def test_layered_load_serves_before_the_last_layer_lands_and_is_exact(tiny_model_dir, reference):
    landed: list[int] = []

    def slow(i, seconds):  # layers 1 and 2 arrive late
        if i >= 1:
            time.sleep(0.3)
        landed.append(i)

    eng = engine(tiny_model_dir, initial_layers=1, on_layer=slow)
    gate = eng.runner.weights.gate
    assert gate is not None and gate.num_ready < 3  # the engine exists before every layer does
    assert eng.generate(PROMPTS, PARAMS) == reference  # the forward waited per layer
    assert landed == [0, 1, 2] and gate.num_ready == 3


def test_layered_load_failure_surfaces_at_the_layer(tiny_model_dir):
    class Broken:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def get(self, name):
            if name.startswith("model.layers.2."):
                raise StoreCorrupt("model.safetensors: truncated at layer 2")
            return self.inner.get(name)

        def read_group(self, names, pin=False):  # the loader's reader thread reads through this
            for name in names:
                self.get(name) if name.startswith("model.layers.2.") else None
            return self.inner.read_group(names, pin)

    eng = engine(tiny_model_dir, weight_source=Broken(SafetensorsReader(tiny_model_dir)), initial_layers=1)
    eng.add_request("a", PROMPTS[0], PARAMS)
    with pytest.raises(StoreCorrupt, match="layer 2 could not be loaded: .*truncated at layer 2"):
        eng.step()


def test_host_copy_fp32_is_exact_and_int8_is_a_quarter(tiny_model_dir, reference):
    reader = SafetensorsReader(tiny_model_dir)
    full = HostCopy.from_reader("tiny", reader)
    assert engine(tiny_model_dir, weight_source=full).generate(PROMPTS, PARAMS) == reference
    small = HostCopy.from_reader("tiny", reader, compression="int8")
    assert small.nbytes < 0.3 * full.nbytes
    eng = engine(tiny_model_dir, weight_source=small)
    # The device holds exactly the expanded INT8 weights, in the compute dtype.
    w = eng.runner.weights.layer(0).o_proj
    qt = small.tensors["model.layers.0.self_attn.o_proj.weight"]
    expanded = w(torch.eye(qt.q.shape[1])).T  # the layer applied to the identity gives back W
    torch.testing.assert_close(expanded, qt.dequantize(torch.float32), rtol=1e-6, atol=1e-7)
    full_w = SafetensorsReader(tiny_model_dir).get("model.layers.0.self_attn.o_proj.weight")
    assert not torch.equal(expanded, full_w)  # and that is not the fp32 original


def _group_expand(scale: torch.Tensor, group: int, cols: int) -> torch.Tensor:
    """A [rows, groups] scale repeated over its group's columns: [rows, cols] (the test's own expansion)."""
    return scale.to(torch.float32).repeat_interleave(group, dim=1)[:, :cols]


def _padded(w: torch.Tensor, g: int) -> torch.Tensor:
    """[rows, groups, g]: a short last group padded with the row's last weight (as the quantizer does)."""
    return torch.cat([w, w[:, -1:].expand(-1, -w.shape[1] % g)], dim=1).view(w.shape[0], -1, g)


def _bound(w: torch.Tensor, qt) -> tuple[torch.Tensor, torch.Tensor]:
    """Per weight, (whether its group took the symmetric grid, the largest error the scheme's theory allows):
    half a step of its group's grid, plus what the clamp can cut when the fp16-rounded minimum or scale
    moved the grid's ends inside the group's range, plus fp32 rounding."""
    g, cols = qt.group_size, w.shape[1]
    s, lo = qt.scale.float(), qt.minimum.float()
    sym = lo == -128 * s
    qmax = _padded(qt.q.float() + 128, g).amax(dim=2)
    steps = torch.where(qmax <= 15, 15.0, 255.0)  # the 4-bit grid's levels are 0..15
    wf = _padded(w, g)
    wmin, wmax, amax = wf.amin(dim=2), wf.amax(dim=2), wf.abs().amax(dim=2)
    cut_asym = (lo - wmin).clamp(min=0) + (wmax - (lo + steps * s)).clamp(min=0)
    cut_sym = (amax - 127 * s).clamp(min=0)
    per_group = s / 2 + torch.where(sym, cut_sym, cut_asym)
    return _group_expand(sym, g, cols).bool(), _group_expand(per_group, g, cols) + 1e-6 * w.abs()


@pytest.mark.parametrize("cols", [128, 150])  # whole groups, and a last group of 22 columns
def test_quantize_int8_error_is_within_its_theory_and_each_group_takes_the_better_grid(cols):
    g = torch.Generator().manual_seed(0)
    # rows of very different scale, one large column per row (a per-row step would be 40x coarser), and
    # rows whose weights are all of one sign (the symmetric grid wastes half its levels there)
    w = torch.randn(64, cols, generator=g) * torch.linspace(0.01, 3.0, 64)[:, None]
    w[:, 5] *= 40.0
    w[:8] = w[:8].abs() + 1.0
    qt = quantize_int8(w, 32)
    assert qt.group_size == 32 and qt.scale.dtype == qt.minimum.dtype == torch.float16
    assert qt.scale.shape == qt.minimum.shape == (64, -(-cols // 32))
    sym, bound = _bound(w, qt)
    err = (qt.dequantize() - w).abs()
    assert torch.all(err <= bound)
    # the bound is the theory's, not a loose one: errors come within 90% of half a step
    assert float((err / _group_expand(qt.scale, 32, cols)).max()) > 0.45
    # both grids are used: one-signed rows take the asymmetric one, some zero-centred groups the symmetric one
    assert not sym[:8].any() and sym[8:].any()
    # each group's squared error is the smaller of the two grids' (the test's own quantizers, fp16 scales)
    wf = _padded(w, 32)
    real = (torch.arange(wf.shape[1] * 32) < cols).float().view(1, -1, 32)  # padding columns are not weights
    lo = wf.amin(dim=2).to(torch.float16).float()[..., None]
    sc = ((wf.amax(dim=2, keepdim=True) - lo) / 255).to(torch.float16).float()
    asym = ((wf - lo) / sc).round().clamp(0, 255) * sc + lo
    sc = (wf.abs().amax(dim=2, keepdim=True) / 127).to(torch.float16).float()
    symm = (wf / sc).round().clamp(-127, 127) * sc
    err2 = (_padded(qt.dequantize(), 32) - wf).square().mul(real).sum(dim=2)
    for alt in (asym, symm):
        assert torch.all(err2 <= (alt - wf).square().mul(real).sum(dim=2) * (1 + 1e-5) + 1e-12)
    assert qt.q.dtype == torch.int8 and qt.nbytes == 64 * cols + 2 * qt.scale.numel() * 2


def test_weights_already_on_an_8_or_4_bit_grid_come_back_exactly():
    """Weights dequantized from GGUF blocks of 32 (Q8_0: q * d; Q4_1: k * d + m, fp16 d and m) keep their
    values: Q8_0's exactly (the symmetric grid is theirs), Q4_1's up to fp32 rounding (the 4-bit grid)."""
    g = torch.Generator().manual_seed(3)
    d = (torch.rand(128, 6, generator=g) * 0.02 + 1e-3).to(torch.float16).float()
    q8 = torch.randint(-127, 128, (128, 6, 32), generator=g).float()
    q8[:, :, 0] = 127  # Q8_0 puts a block's largest magnitude at +-127
    w8 = (q8 * d[..., None]).view(128, 192)
    assert torch.equal(quantize_int8(w8).dequantize(), w8)
    m = (torch.rand(128, 6, generator=g) * -0.05).to(torch.float16).float()
    k = torch.randint(0, 16, (128, 6, 32), generator=g).float()
    k[:, :, 0], k[:, :, 1] = 0, 15  # Q4_1 spans a block's [min, max] with levels 0 and 15
    w4 = (k * d[..., None] + m[..., None]).view(128, 192)
    q4 = quantize_int8(w4)
    # most groups take the 4-bit grid (where d / 17 is itself an fp16 value the 255-level one is exact too)
    assert float(((q4.q.float() + 128).view(128, 6, 32).amax(dim=2) <= 15).float().mean()) > 0.8
    # up to fp32 rounding: 1e-5 of a step (the 255-level grid alone is off by up to 15 * d * 2^-11 = 7e-3 d)
    assert torch.all((q4.dequantize() - w4).abs().view(128, 6, 32) <= 1e-5 * d[..., None])
    for weights, qt in ((w8, quantize_int8(w8)), (w4, q4)):  # the same bf16 weights as a direct cast
        assert torch.equal(qt.dequantize(torch.bfloat16), weights.to(torch.bfloat16))
    # groups of 64 straddle two blocks of different grids: far from exact
    assert float((quantize_int8(w4, 64).dequantize() - w4).abs().max()) > 1e-3 * float(d.min())


def test_int8_file_roundtrip_and_fewer_bytes(tiny_model_dir, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    reader = SafetensorsReader(d)
    path = write_int8(reader, d)
    assert path == int8_path(d) and path.stat().st_size < 0.35 * sum(p.stat().st_size for p in d.glob("*.safetensors"))
    r8 = Int8Reader(path)
    host8 = HostCopy.from_reader("tiny", reader, compression="int8")
    assert r8.names() == reader.names()
    for name in reader.names():
        assert r8.shape(name) == reader.shape(name)
        assert torch.equal(r8.get(name), host8.get(name))
    assert SafetensorsReader(d).names() == reader.names()  # the int8/ subdir is not taken for a shard


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_expands_straight_into_the_compute_dtype(dtype):
    """One pass (q * s + offset computed in fp32, rounded once) gives the three-pass result bit for bit; a
    QTensor without an offset (symmetric only) expands as q * s."""
    from gpuservd.runner.qtensor import QTensor

    for cols in (128, 40):  # whole and short groups
        qt = quantize_int8(torch.randn(96, cols, generator=torch.Generator().manual_seed(1)), 32)
        for minimum in (qt.minimum, None):
            qt = QTensor(qt.q, qt.scale, qt.group_size, minimum)
            got = qt.dequantize(dtype)
            s = _group_expand(qt.scale, qt.group_size, cols)
            if minimum is not None:
                bias = _group_expand(qt.minimum, qt.group_size, cols) + 128 * s
                want = torch.addcmul(bias, qt.q.to(torch.float32), s).to(dtype)
            else:
                want = (qt.q.to(torch.float32) * s).to(dtype)
            assert got.dtype == dtype and torch.equal(got, want)


def test_tensor_ranges_point_at_each_tensors_bytes(tmp_path):
    """The byte ranges read ahead are the tensors' own bytes in the file."""
    from safetensors.torch import save_file

    from gpuservd.store.readahead import tensor_ranges

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=g), "b.q": torch.randint(-5, 5, (7,), dtype=torch.int8),
               "c": torch.randn(4, generator=g).to(torch.bfloat16)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    data = path.read_bytes()
    ranges = tensor_ranges(path)
    assert set(ranges) == set(tensors)
    for k, t in tensors.items():
        start, end = ranges[k]
        assert data[start:end] == t.contiguous().view(torch.uint8).numpy().tobytes()


def test_layers_are_read_ahead_of_the_loader(tiny_model_dir, tmp_path):
    """Every layer's tensors are asked for (WILLNEED) before the loader reads them, two layers ahead,
    from the store's safetensors and from the INT8 file alike."""
    import shutil

    from gpuservd.runner.model_config import load_arch
    from gpuservd.runner.load import READ_AHEAD_LAYERS, load_weights
    from gpuservd.weights.int8_file import Int8Reader, int8_path, write_int8

    arch = load_arch(tiny_model_dir)

    def recording(reader):
        log = []
        get, prefetch = reader.get, reader.prefetch
        reader.get = lambda name: (log.append(("get", name)), get(name))[1]
        reader.prefetch = lambda names: (log.extend(("prefetch", n) for n in names), prefetch(names))[1]
        return log

    d = tiny_model_dir
    for reader in (SafetensorsReader(d), None):
        if reader is None:
            shutil.copytree(d, tmp_path / "m")
            write_int8(SafetensorsReader(tmp_path / "m"), tmp_path / "m")
            reader = Int8Reader(int8_path(tmp_path / "m"))
        log = recording(reader)
        load_weights(reader, arch, torch.float32, torch.device("cpu"))
        asked = {n: i for i, (what, n) in enumerate(log) if what == "prefetch"}
        read = [(i, n) for i, (what, n) in enumerate(log) if what == "get"]
        assert set(asked) == set(reader.names())  # every tensor is read ahead, once
        assert all(asked[n] < i for i, n in read)  # and before it is read
        # Layer i + READ_AHEAD_LAYERS is asked for before any of layer i's tensors is read.
        first_get = {int(n.split(".")[2]): i for i, n in reversed(read) if n.startswith("model.layers.")}
        for layer, i in first_get.items():
            ahead = layer + READ_AHEAD_LAYERS
            if ahead in first_get:
                assert min(asked[n] for n in reader.names() if n.startswith(f"model.layers.{ahead}.")) < i


def _old_per_row_file(model_dir) -> None:
    """An INT8 file as gpuservs before the group-wise format wrote it: one fp32 scale per row, no marker."""
    from safetensors.torch import save_file

    reader = SafetensorsReader(model_dir)
    tensors = {}
    for name in reader.names():
        t = reader.get(name)
        if t.dim() == 2:
            scale = t.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            tensors[name + ".q"] = torch.round(t / scale[:, None]).clamp(-127, 127).to(torch.int8)
            tensors[name + ".scale"] = scale
        else:
            tensors[name] = t
    int8_path(model_dir).parent.mkdir(exist_ok=True)
    save_file(tensors, str(int8_path(model_dir)), metadata={"format": "pt", "gpuserv": "int8-per-row-symmetric"})


def _grouped_file(model_dir, marker: str, group: int) -> None:
    """An INT8 file in an earlier group-wise format's layout (2: groups of 64; 3: groups of 32, whose values
    lack the 4-bit grid)."""
    from safetensors.torch import save_file

    reader = SafetensorsReader(model_dir)
    tensors = {}
    for name in reader.names():
        t = reader.get(name)
        if t.dim() == 2:
            qt = quantize_int8(t, group)
            tensors[name + ".q"], tensors[name + ".scale"], tensors[name + ".min"] = qt.q, qt.scale, qt.minimum
        else:
            tensors[name] = t
    save_file(tensors, str(int8_path(model_dir)), metadata={"format": "pt", "gpuserv_int8": marker,
                                                            "group_size": str(group)})


def test_an_int8_file_of_the_old_format_is_made_again_never_misread(tiny_model_dir, tmp_path):
    import shutil

    from gpuservd.weights.int8_file import FORMAT, Int8Stale, ensure_int8, int8_format, read_agreement, \
        write_agreement
    from gpuservd.weights.sources import store_source

    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    _old_per_row_file(d)
    write_agreement(d, {"teacher_forced_top1": 0.5})
    with pytest.raises(Int8Stale, match="format 1 .per-row., this gpuserv reads format 4"):
        Int8Reader(int8_path(d))  # its [out] scales would broadcast wrongly over groups: refused, not read
    # the daemon's store source makes it again, in the current format, and reads that
    source, tier, nbytes = store_source(d, "int8")
    assert tier == "disk-int8" and int8_format(int8_path(d)) == FORMAT == "4"
    assert read_agreement(d) is None  # measured on the old file: not this file's numbers
    fresh = tmp_path / "fresh"
    shutil.copytree(tiny_model_dir, fresh)
    Int8Reader(write_int8(SafetensorsReader(fresh), fresh))
    for name in source.names():
        assert torch.equal(source.get(name), Int8Reader(int8_path(fresh)).get(name))
    # files of formats 2 and 3 (their agreement measured on them) are refused and made again as well
    for marker, group in (("2", 64), ("3", 32)):
        _grouped_file(d, marker, group)
        write_agreement(d, {"teacher_forced_top1": 0.971})
        with pytest.raises(Int8Stale, match=f"format {marker}, this gpuserv reads format 4"):
            Int8Reader(int8_path(d))
        source, _, _ = store_source(d, "int8")
        assert int8_format(int8_path(d)) == "4" and source.group_size == 32 and read_agreement(d) is None
        for name in source.names():
            assert torch.equal(source.get(name), Int8Reader(int8_path(fresh)).get(name))
    # a file that is not safetensors at all is made again too
    int8_path(d).write_bytes(b"torn")
    assert int8_format(ensure_int8(SafetensorsReader(d), d)) == FORMAT
    # a current file is left alone, and its stored numbers are its own until it changes
    before = int8_path(d).stat().st_mtime_ns
    write_agreement(d, {"teacher_forced_top1": 0.97})
    assert ensure_int8(SafetensorsReader(d), d) == int8_path(d) and int8_path(d).stat().st_mtime_ns == before
    assert read_agreement(d)["teacher_forced_top1"] == 0.97

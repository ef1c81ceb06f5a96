"""`engine.dtype: auto`: bf16 where the hardware computes in it (CUDA, AVX512_BF16), fp32 elsewhere, and why."""

from __future__ import annotations

import pytest

from gpuservd.config import EngineConfig, config_from_dict
from gpuservd.errors import UserError
from gpuservd.dtypes import choose_dtype, cpu_flags

ZEN4 = {"fpu", "sse2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}
AVX2_ONLY = {"fpu", "sse2", "avx", "avx2", "fma"}
SKYLAKE_X = {"fpu", "sse2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl"}


@pytest.mark.parametrize("device,flags,dtype,why", [
    ("cpu", ZEN4, "bfloat16", "has AVX512_BF16"),
    ("cpu", AVX2_ONLY, "float32", "no AVX512_BF16 (AVX2 only)"),
    ("cpu", SKYLAKE_X, "float32", "no AVX512_BF16 (AVX-512 only)"),  # AVX-512 without the bf16 dot product
    ("cpu:1", set(), "float32", "no AVX2"),
    ("cuda:0", AVX2_ONLY, "bfloat16", "cuda:0: GPUs compute in bf16"),  # the CPU does not matter on a GPU
])
def test_the_chooser_reads_the_device_and_the_cpu_flags(device, flags, dtype, why):
    got, reason = choose_dtype(device, flags)
    assert got == dtype and why in reason


def test_cpu_flags_come_from_proc_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


def test_auto_is_the_default_and_resolves_with_its_reason():
    cfg = EngineConfig()
    assert cfg.dtype == "auto"
    cfg.resolve_dtype("cpu", ZEN4)
    assert cfg.dtype == "bfloat16" and cfg.dtype_reason.startswith("auto: the CPU has AVX512_BF16")
    cfg = EngineConfig()
    cfg.resolve_dtype("cpu", AVX2_ONLY)
    assert cfg.dtype == "float32" and "AVX2 only" in cfg.dtype_reason
    # validate() resolves it for this machine, as the daemon, the CLI and the benches do
    cfg = EngineConfig()
    cfg.validate()
    assert (cfg.dtype, cfg.dtype_reason) == (choose_dtype("cpu")[0], "auto: " + choose_dtype("cpu")[1])


def test_an_explicit_dtype_is_kept_and_says_so():
    cfg = config_from_dict({"engine": {"dtype": "float32"}})
    assert cfg.dtype == "float32" and cfg.dtype_reason == "set in the config (engine.dtype)"
    cfg.resolve_dtype("cpu", ZEN4)  # a CPU that would choose bf16 does not override it
    assert cfg.dtype == "float32"


def test_the_reason_is_not_a_config_key():
    with pytest.raises(UserError, match="unknown key engine.'dtype_reason'"):
        config_from_dict({"engine": {"dtype_reason": "because"}})
    with pytest.raises(UserError, match="engine.dtype must be auto, float32"):
        config_from_dict({"engine": {"dtype": "int4"}})


def test_an_avx2_cap_chooses_as_an_avx2_only_cpu(monkeypatch):
    # GPUSERV_CPU_ISA=avx2 builds no AVX-512 kernels, so bf16 would run widened to fp32: auto picks fp32
    monkeypatch.setenv("GPUSERV_CPU_ISA", "avx2")
    dtype, why = choose_dtype("cpu", ZEN4)
    assert dtype == "float32" and "AVX2 only (GPUSERV_CPU_ISA=avx2)" in why
    assert choose_dtype("cuda:0", ZEN4)[0] == "bfloat16"  # a GPU is not held by the CPU's ISA
    monkeypatch.setenv("GPUSERV_CPU_ISA", "native")
    assert choose_dtype("cpu", ZEN4)[0] == "bfloat16"

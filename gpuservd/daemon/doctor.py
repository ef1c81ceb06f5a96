"""`gpuserv doctor`: check the box and the daemon, list the active hints.

Each check returns a `Check` with a status: `ok`, `info` (worth knowing,
nothing wrong), `skip` (does not apply here, e.g. MPS without a GPU), `warn`
(works, but degraded: no GPU, no daemon answering) or `critical` (broken:
the disk is full, the daemon's engines are dead, the device reports errors).
The exit code is 2 with any critical, 1 with any warning, else 0.

A missing GPU is a warning with the reason (CPU-only torch build, no NVIDIA
driver, no device visible), never a crash: the engine runs on the CPU. Every
check takes its outside world as arguments (a torch module, an NVML module,
a command runner, a client) so the tests drive each branch without the
hardware. torch is imported only inside `run_checks`.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from gpuservd.api.client import Client, DaemonError, DaemonUnavailable
from gpuservd.errors import UserError
from gpuservd.gpu.backends import choose_backend
from gpuservd.paths import client_socket_path, models_root
from gpuservd.serving.daemon_config import load_daemon_config

GIB = 1 << 30
LEVELS = {"ok": 0, "info": 0, "skip": 0, "warn": 1, "critical": 2}


@dataclass
class Check:
    name: str  # what was checked
    status: str  # ok | info | skip | warn | critical
    summary: str  # one line for a person
    detail: dict = field(default_factory=dict)  # the numbers behind it

    def to_dict(self) -> dict:
        return asdict(self)


def exit_code(checks: list[Check]) -> int:
    return max((LEVELS[c.status] for c in checks), default=0)


def check_python(version=sys.version_info) -> Check:
    v = f"{version[0]}.{version[1]}.{version[2]}"
    if tuple(version[:2]) < (3, 11):
        return Check("python", "critical", f"Python {v}; gpuserv needs 3.11 or newer", {"version": v})
    return Check("python", "ok", f"Python {v} ({sys.executable})", {"version": v})


def _no_gpu_reason(torch, driver_file: Path, env: dict) -> str:
    if not getattr(torch.version, "cuda", None):
        return f"torch {torch.__version__} is a CPU-only build (no CUDA runtime)"
    if env.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "CUDA_VISIBLE_DEVICES is empty: every device is hidden"
    if not driver_file.exists():
        return f"no NVIDIA driver loaded ({driver_file} is missing)"
    return "the driver sees no usable CUDA device"


def check_torch(torch, driver_file: Path = Path("/proc/driver/nvidia/version"), env=os.environ) -> list[Check]:
    """torch itself, then the GPU (CUDA build, driver, devices)."""
    cuda = getattr(torch.version, "cuda", None)
    out = [Check("torch", "ok", f"torch {torch.__version__}" + (f", CUDA {cuda}" if cuda else ", CPU build"),
                 {"version": torch.__version__, "cuda": cuda})]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out.append(Check("gpu", "ok", f"{len(names)} CUDA device(s): {', '.join(names)}", {"devices": names}))
    else:
        reason = _no_gpu_reason(torch, driver_file, env)
        out.append(Check("gpu", "warn", f"no GPU: {reason}; the engine runs on the CPU (device: cpu)",
                         {"reason": reason}))
    return out


def check_nvml(nvml) -> Check:
    """The driver and NVML (device readings, health, Xid)."""
    if nvml is None:
        return Check("nvml", "warn", "nvidia-ml-py is not installed: no device readings", {})
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return Check("nvml", "warn", f"NVML unavailable ({exc}): no device readings or health checks",
                     {"error": str(exc)})
    try:
        driver = nvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        n = nvml.nvmlDeviceGetCount()
        return Check("nvml", "ok", f"NVIDIA driver {driver}, {n} device(s) through NVML",
                     {"driver": driver, "num_devices": n})
    finally:
        nvml.nvmlShutdown()


def check_green_contexts(torch) -> Check:
    """SM partitions inside one process (torch.cuda.green_contexts; the CUDA driver documents SM splits for
    compute capability 7.0 and newer, with 8-SM granules from 9.0: see sharing/hardware.py)."""
    if not torch.cuda.is_available():
        return Check("green_contexts", "skip", "no CUDA device: SM partitions are not enforced", {})
    has_api = hasattr(getattr(torch.cuda, "green_contexts", None), "GreenContext")
    major, minor = torch.cuda.get_device_capability(0)
    if not has_api:
        return Check("green_contexts", "info", f"torch {torch.__version__} has no torch.cuda.green_contexts; "
                     "SM partitions fall back to MPS", {"capability": f"{major}.{minor}"})
    if major < 7:
        return Check("green_contexts", "info", f"compute capability {major}.{minor}: green contexts need 7.0+; "
                     "SM partitions fall back to MPS", {"capability": f"{major}.{minor}"})
    return Check("green_contexts", "ok", f"green contexts available (compute capability {major}.{minor})",
                 {"capability": f"{major}.{minor}"})


def check_sharing(sharing, device: str, choose=None) -> Check:
    """What the daemon will enforce between models with this config (the SM partition backend it will pick)."""
    choose = choose or choose_backend
    try:
        backend = choose(sharing.backend, device)
    except UserError as exc:  # asked for a backend this box does not have: the daemon will not start
        return Check("sharing", "critical", str(exc), {"backend": sharing.backend.value, "device": device})
    st = backend.status()
    detail = {"backend": st.get("name"), "enforced": bool(st.get("enforced")), "device": device,
              "arbiter": bool(sharing.enabled), "quantum_ms": sharing.quantum_ms}
    arbiter = (f"; time slices of {sharing.quantum_ms:g} ms between models" if sharing.enabled
               else "; sharing.enabled is false: models step whenever they like (naive co-location)")
    if not device.startswith("cuda"):
        return Check("sharing", "skip", st["summary"] + arbiter, detail)
    return Check("sharing", "ok" if st.get("enforced") else "warn", st["summary"] + arbiter, detail)


def check_mps(gpu: bool, proc: Path = Path("/proc"), env=os.environ) -> Check:
    """The CUDA MPS control daemon (the SM-partition fallback for worker processes)."""
    if not gpu:
        return Check("mps", "skip", "no CUDA device: MPS does not apply", {})
    pipe = Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps")
    running = any((p / "comm").read_text().strip() == "nvidia-cuda-mps-control"
                  for p in proc.iterdir() if p.name.isdigit() and (p / "comm").exists())
    if running:
        return Check("mps", "ok", f"MPS control daemon running (pipes in {pipe})", {"pipe_dir": str(pipe)})
    return Check("mps", "info", "MPS control daemon not running (only needed when green contexts are not)",
                 {"pipe_dir": str(pipe)})


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(store: Path, usage=shutil.disk_usage) -> Check:
    """Free space where the model store lives (a model is converted beside it, then renamed in)."""
    where = _existing(store)
    du = usage(where)
    size = sum(f.stat().st_size for f in store.rglob("*") if f.is_file()) if store.is_dir() else 0
    detail = {"path": str(store), "free_bytes": du.free, "total_bytes": du.total, "store_bytes": size}
    text = f"{du.free / GIB:.1f} GiB free of {du.total / GIB:.1f} GiB at {where}; store {size / GIB:.2f} GiB"
    if du.free < GIB:
        return Check("disk", "critical", text + ": under 1 GiB, a pull or import will fail", detail)
    if du.free < 10 * GIB:
        return Check("disk", "warn", text + ": under 10 GiB, room for few models", detail)
    return Check("disk", "ok", text, detail)


def check_socket(path: Path) -> Check:
    """The daemon's socket: a socket, not world-accessible, and usable by this user."""
    if not path.exists():
        return Check("socket", "warn", f"no socket at {path} (the daemon is not running there)", {"path": str(path)})
    st = path.stat()
    mode = stat.S_IMODE(st.st_mode)
    detail = {"path": str(path), "mode": f"{mode:04o}", "uid": st.st_uid, "gid": st.st_gid}
    if not stat.S_ISSOCK(st.st_mode):
        return Check("socket", "critical", f"{path} exists but is not a socket", detail)
    if mode & 0o007:
        return Check("socket", "warn", f"{path} is mode {mode:04o}: any local user can talk to the daemon "
                     "(server.socket_mode 0660 and a group)", detail)
    if not os.access(path, os.R_OK | os.W_OK):
        return Check("socket", "warn", f"{path} is mode {mode:04o} and this user ({os.getuid()}) may not use it; "
                     "join its group", detail)
    return Check("socket", "ok", f"{path} mode {mode:04o}, usable by this user", detail)


def check_systemd(run=subprocess.run, user: bool = False) -> Check:
    """The gpuservd unit's state (when systemd runs this box)."""
    cmd = ["systemctl"] + (["--user"] if user else []) + ["show", "-p", "LoadState,ActiveState,SubState",
                                                          "gpuservd.service"]
    try:
        proc = run(cmd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check("systemd", "skip", f"systemctl unavailable ({exc})", {})
    props = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    if proc.returncode != 0 or not props:
        why = (proc.stderr or "").strip().splitlines()
        return Check("systemd", "skip", f"systemd not reachable: {why[0] if why else f'exit {proc.returncode}'}", {})
    if props.get("LoadState") == "not-found":
        return Check("systemd", "info", "gpuservd.service is not installed (gpuserv systemd install)", props)
    state = f"{props.get('ActiveState')} ({props.get('SubState')})"
    if props.get("ActiveState") == "failed":
        return Check("systemd", "critical", f"gpuservd.service {state}: see journalctl -u gpuservd", props)
    return Check("systemd", "ok" if props.get("ActiveState") == "active" else "info",
                 f"gpuservd.service {state}", props)


def check_decode_path(model: dict) -> Check:
    """How a model's decode steps run: CUDA graphs, or eager and why (warn when graphs were asked for or
    expected on a CUDA device and are not used)."""
    d = model["decode"]
    name = model["name"]
    if d.get("path") == "cuda_graphs":
        took = d.get("capture_s")
        overlap = {True: "; overlap on", False: "; overlap off"}.get(d.get("overlap"), "")
        return Check(f"decode:{name}", "ok", f"{name}: decode steps replay CUDA graphs for batch sizes "
                     f"{','.join(map(str, d.get('captured', [])))} (captured in {took} s, {d.get('kernels')} kernels"
                     f"{overlap})", d)
    cuda = str(model.get("device", "")).startswith("cuda")
    reason = d.get("reason") or "eager"
    degraded = "asked for" in reason or (cuda and "enabled is false" not in reason and "=0" not in reason)
    return Check(f"decode:{name}", "warn" if degraded else "info",
                 f"{name}: decode steps run eagerly ({reason}; kernels: {d.get('kernels')})", d)


def check_daemon(client) -> tuple[list[Check], list[dict]]:
    """The daemon's health and models, and its active hints (each one a check of its own)."""
    try:
        health = client.request("GET", "/health")
    except DaemonUnavailable as exc:
        return [Check("daemon", "warn", str(exc), {})], []
    except DaemonError as exc:
        return [Check("daemon", "critical", f"unhealthy: {exc}", {"body": exc.body})], []
    status = client.status_dict()
    models = status.get("models", [])
    failed = [m["name"] for m in models if m.get("state") == "failed"]
    text = f"gpuservd {status.get('version')} (pid {status.get('pid')}) {status.get('state')}; " + \
        (", ".join(f"{m['name']} {m['state']}" for m in models) or "no models")
    checks = [Check("daemon", "warn" if failed else "ok", text + (f"; failed: {', '.join(failed)}" if failed else ""),
                    {"health": health, "state": status.get("state"), "failed_models": failed})]
    checks += [check_decode_path(m) for m in models if m.get("decode")]
    hints = status.get("hints")
    if hints is None:
        checks.append(Check("hints", "info", "this daemon reports no hints", {}))
        return checks, []
    for h in hints:
        where = f" ({h['model']})" if h.get("model") else ""
        checks.append(Check(f"hint:{h['name']}", "critical" if h["name"] == "device_errors" else "warn",
                            f"{h.get('symptom')}{where}: {h.get('action')}", h.get("evidence") or {}))
    unfed = [r["name"] for r in status.get("hint_rules", []) if not r.get("fed")]
    if unfed:
        checks.append(Check("hint_rules", "info", f"{len(unfed)} rules have no data source in this daemon yet: "
                            f"{', '.join(unfed)}", {"unfed": unfed}))
    return checks, hints


def run_checks(socket_path: Path | None = None, store: Path | None = None) -> dict:
    """Every check against this box and the daemon at socket_path; {"checks", "hints", "exit_code"}."""
    import torch  # only here: the checks take their outside world as arguments (module docstring)

    try:
        import pynvml as nvml  # here, like torch; a missing NVML is a finding, not a crash
    except ImportError:
        nvml = None
    sock = Path(socket_path) if socket_path else client_socket_path()

    checks = [check_python(), *check_torch(torch), check_nvml(nvml), check_green_contexts(torch),
              check_mps(torch.cuda.is_available())]
    try:
        cfg = load_daemon_config(None)
        checks.append(check_sharing(cfg.sharing, cfg.engine.device))
    except UserError as exc:
        checks.append(Check("config", "critical", str(exc), {}))
    checks += [check_disk(store or models_root()), check_socket(sock), check_systemd()]
    with Client(sock) as client:
        daemon, hints = check_daemon(client)
    checks += daemon
    return {"checks": [c.to_dict() for c in checks], "hints": hints, "exit_code": exit_code(checks)}

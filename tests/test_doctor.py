"""`gpuserv doctor`: each check on the states it can meet (fake torch / NVML / systemctl / daemon), the exit
codes, and the real command on this box (no GPU: a warning with the reason, never a crash)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpuservd.daemon import doctor
from gpuservd.api.client import DaemonError, DaemonUnavailable
from gpuservd.daemon.doctor import Check, exit_code
from test_cli import invoke


def fake_torch(cuda_version=None, available=False, capability=(9, 0), green=True):
    cuda = SimpleNamespace(is_available=lambda: available, device_count=lambda: 2,
                           get_device_name=lambda i: f"NVIDIA H200 #{i}", get_device_capability=lambda i: capability)
    if green:
        cuda.green_contexts = SimpleNamespace(GreenContext=object)
    return SimpleNamespace(__version__="2.13.0", version=SimpleNamespace(cuda=cuda_version), cuda=cuda)


def test_exit_codes():
    assert exit_code([Check("a", "ok", ""), Check("b", "skip", ""), Check("c", "info", "")]) == 0
    assert exit_code([Check("a", "ok", ""), Check("b", "warn", "")]) == 1
    assert exit_code([Check("a", "warn", ""), Check("b", "critical", "")]) == 2


def test_python():
    assert doctor.check_python((3, 11, 7)).status == "ok"
    assert doctor.check_python((3, 9, 1)).status == "critical"


@pytest.mark.parametrize("cuda,env,driver,reason", [
    (None, {}, True, "CPU-only build"),
    ("12.8", {"CUDA_VISIBLE_DEVICES": ""}, True, "CUDA_VISIBLE_DEVICES is empty"),
    ("12.8", {}, False, "no NVIDIA driver loaded"),
    ("12.8", {}, True, "sees no usable CUDA device"),
])
def test_missing_gpu_is_a_warning_with_the_reason(tmp_path, cuda, env, driver, reason):
    driver_file = tmp_path / "version"
    if driver:
        driver_file.write_text("NVRM version: 570")
    torch_check, gpu = doctor.check_torch(fake_torch(cuda), driver_file, env)
    assert torch_check.status == "ok"
    assert gpu.status == "warn" and reason in gpu.summary and gpu.detail["reason"]


def test_gpu_present():
    _, gpu = doctor.check_torch(fake_torch("12.8", available=True))
    assert gpu.status == "ok" and gpu.detail["devices"] == ["NVIDIA H200 #0", "NVIDIA H200 #1"]


def test_nvml():
    class Missing(Exception):
        pass

    def fail():
        raise Missing("NVML Shared Library Not Found")

    shut = []
    ok = SimpleNamespace(nvmlInit=lambda: None, nvmlSystemGetDriverVersion=lambda: b"570.86",
                         nvmlDeviceGetCount=lambda: 8, nvmlShutdown=lambda: shut.append(1))
    c = doctor.check_nvml(ok)
    assert c.status == "ok" and c.detail == {"driver": "570.86", "num_devices": 8} and shut == [1]
    c = doctor.check_nvml(SimpleNamespace(nvmlInit=fail))
    assert c.status == "warn" and "Library Not Found" in c.summary
    assert doctor.check_nvml(None).status == "warn"


def test_green_contexts():
    assert doctor.check_green_contexts(fake_torch()).status == "skip"
    assert doctor.check_green_contexts(fake_torch("12.8", True, (9, 0))).status == "ok"
    assert doctor.check_green_contexts(fake_torch("12.8", True, (8, 0))).status == "ok"
    assert doctor.check_green_contexts(fake_torch("12.8", True, (6, 1))).status == "info"
    assert "no torch.cuda.green_contexts" in doctor.check_green_contexts(fake_torch("12.8", True, green=False)).summary


def test_sharing_says_what_the_daemon_will_enforce():
    from gpuservd.sharing.config import SharingConfig, sharing_from_dict

    c = doctor.check_sharing(SharingConfig(), "cpu")
    assert c.status == "skip" and c.summary.startswith("SM partitions: not enforced (no CUDA device)")
    assert "time slices of 20 ms" in c.summary and c.detail["backend"] == "none"
    c = doctor.check_sharing(sharing_from_dict({"backend": "green_context"}, "t"), "cpu")
    assert c.status == "critical" and "sharing.backend green_context is not available on cpu" in c.summary
    c = doctor.check_sharing(sharing_from_dict({"enabled": False}, "t"), "cpu")
    assert "naive co-location" in c.summary


def test_mps(tmp_path):
    assert doctor.check_mps(False).status == "skip"
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "comm").write_text("python\n")
    assert doctor.check_mps(True, tmp_path, {}).status == "info"
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "comm").write_text("nvidia-cuda-mps-control\n")
    c = doctor.check_mps(True, tmp_path, {"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"})
    assert c.status == "ok" and c.detail["pipe_dir"] == "/run/mps"


Usage = namedtuple("Usage", "total used free")


@pytest.mark.parametrize("free,status", [(100 << 30, "ok"), (5 << 30, "warn"), (1 << 20, "critical")])
def test_disk(tmp_path, free, status):
    store = tmp_path / "models"
    (store / "m").mkdir(parents=True)
    (store / "m" / "w.safetensors").write_bytes(b"x" * 1000)
    c = doctor.check_disk(store, lambda p: Usage(200 << 30, 0, free))
    assert c.status == status and c.detail["store_bytes"] == 1000 and c.detail["free_bytes"] == free
    assert doctor.check_disk(tmp_path / "not" / "yet", lambda p: Usage(1, 0, 100 << 30)).detail["store_bytes"] == 0


def test_socket(tmp_path):
    path = tmp_path / "gs.sock"
    assert doctor.check_socket(path).status == "warn"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    try:
        os.chmod(path, 0o660)
        c = doctor.check_socket(path)
        assert c.status == "ok" and c.detail["mode"] == "0660"
        os.chmod(path, 0o666)
        assert "any local user" in doctor.check_socket(path).summary
    finally:
        s.close()
    other = tmp_path / "plain"
    other.write_text("")
    assert doctor.check_socket(other).status == "critical"


def systemctl(stdout="", returncode=0, stderr="", raises=None):
    def run(cmd, **kw):
        if raises:
            raise raises
        assert cmd[0] == "systemctl" and "gpuservd.service" in cmd
        return subprocess.CompletedProcess(cmd, returncode, stdout, stderr)

    return run


@pytest.mark.parametrize("run,status,text", [
    (systemctl("LoadState=loaded\nActiveState=active\nSubState=running\n"), "ok", "active (running)"),
    (systemctl("LoadState=loaded\nActiveState=failed\nSubState=failed\n"), "critical", "journalctl"),
    (systemctl("LoadState=not-found\nActiveState=inactive\nSubState=dead\n"), "info", "not installed"),
    (systemctl("", 1, "System has not been booted with systemd"), "skip", "not been booted"),
    (systemctl(raises=FileNotFoundError("systemctl")), "skip", "unavailable"),
])
def test_systemd(run, status, text):
    c = doctor.check_systemd(run)
    assert c.status == status and text in c.summary


class FakeClient:
    def __init__(self, health=None, status=None, error=None):
        self._health, self._status, self._error = health, status, error

    def request(self, method, path):
        if self._error:
            raise self._error
        return self._health

    def status_dict(self):
        return self._status


HINT = {"name": "kv_quota_small", "model": "m", "symptom": "KV cache nearly full", "action": "raise it",
        "evidence": {"kv_blocks_total": 80}}


def test_daemon_checks():
    checks, hints = doctor.check_daemon(FakeClient(error=DaemonUnavailable("/x.sock")))
    assert [c.status for c in checks] == ["warn"] and hints == []
    checks, _ = doctor.check_daemon(FakeClient(error=DaemonError(503, "unhealthy", body={"dead_engines": ["m"]})))
    assert checks[0].status == "critical"
    status = {"version": "0.1", "pid": 1, "state": "serving", "models": [{"name": "m", "state": "ready"},
                                                                        {"name": "b", "state": "failed"}],
              "hints": [HINT, {**HINT, "name": "device_errors", "model": None}],
              "hint_rules": [{"name": "bandwidth_bound", "fed": False}, {"name": "kv_quota_small", "fed": True}]}
    checks, hints = doctor.check_daemon(FakeClient({"status": "ok"}, status))
    by = {c.name: c for c in checks}
    assert by["daemon"].status == "warn" and by["daemon"].detail["failed_models"] == ["b"]
    assert by["hint:kv_quota_small"].status == "warn" and by["hint:kv_quota_small"].detail == {"kv_blocks_total": 80}
    assert by["hint:device_errors"].status == "critical"
    assert by["hint_rules"].detail == {"unfed": ["bandwidth_bound"]} and len(hints) == 2
    checks, _ = doctor.check_daemon(FakeClient({"status": "ok"}, {"models": []}))
    assert [c.status for c in checks] == ["ok", "info"]  # an older daemon without hints


def test_doctor_command_on_this_box(tmp_path, monkeypatch, capsys):
    """No daemon at the socket and (here) no GPU: warnings, exit 1; the JSON says why."""
    monkeypatch.setenv("GPUSERV_HOME", str(tmp_path))
    code = invoke("doctor", "--json", "--socket", str(tmp_path / "none.sock"))
    report = json.loads(capsys.readouterr().out)
    checks = {c["name"]: c for c in report["checks"]}
    assert code == report["exit_code"] == 1
    assert set(checks) >= {"python", "torch", "gpu", "nvml", "green_contexts", "mps", "sharing", "disk", "socket", "systemd",
                           "daemon"}
    import torch

    if not torch.cuda.is_available():
        assert checks["gpu"]["status"] == "warn" and checks["gpu"]["detail"]["reason"]
    assert checks["daemon"]["status"] == "warn" and "no daemon answers" in checks["daemon"]["summary"]
    invoke("doctor", "--socket", str(tmp_path / "none.sock"))
    text = capsys.readouterr().out
    assert "WARN  daemon" in text and text.strip().endswith("doctor: warnings")


def test_run_checks_uses_the_given_store(tmp_path):
    report = doctor.run_checks(tmp_path / "none.sock", store=Path(tmp_path))
    disk = next(c for c in report["checks"] if c["name"] == "disk")
    assert disk["detail"]["path"] == str(tmp_path)


def test_decode_path_checks():
    """Doctor says how each model's decode steps run; eager where graphs were expected is a warning."""
    graphs = {"path": "cuda_graphs", "captured": [1, 2, 4], "capture_s": 1.5, "kernels": "triton", "reason": "CUDA graphs",
              "overlap": True}
    cpu = {"path": "eager", "reason": "eager on cpu", "kernels": "c++"}
    asked = {"path": "eager", "reason": "CUDA graphs asked for, but the device is cpu: eager", "kernels": "c++"}
    no_triton = {"path": "eager", "reason": "eager: the Triton kernels are not available", "kernels": "torch"}
    off = {"path": "eager", "reason": "eager (GPUSERV_CUDA_GRAPHS=0)", "kernels": "triton"}
    models = [{"name": "g", "state": "ready", "device": "cuda:0", "decode": graphs},
              {"name": "c", "state": "ready", "device": "cpu", "decode": cpu},
              {"name": "a", "state": "ready", "device": "cpu", "decode": asked},
              {"name": "t", "state": "ready", "device": "cuda:0", "decode": no_triton},
              {"name": "o", "state": "ready", "device": "cuda:0", "decode": off},
              {"name": "old", "state": "ready"}]
    checks, _ = doctor.check_daemon(FakeClient({"status": "ok"}, {"models": models}))
    by = {c.name: c for c in checks}
    assert by["decode:g"].status == "ok" and "replay CUDA graphs for batch sizes 1,2,4" in by["decode:g"].summary
    assert by["decode:g"].summary.endswith("triton kernels; overlap on)")  # step N+1 launched before N is read
    assert by["decode:c"].status == "info" and "eagerly (eager on cpu" in by["decode:c"].summary
    assert by["decode:a"].status == "warn" and by["decode:t"].status == "warn"
    assert by["decode:o"].status == "info" and "decode:old" not in by

"""The Partitions screen and the dashboard's Device panel on the GPU-sharing sections of /admin/status.

Two statuses: `sharing_cpu_status.json`, recorded from the real daemon (`gpuserv status --json`) with two
tiny models time-sliced on this CPU under load (backend none, arbiter on, a best-effort model throttled),
and a CUDA-shaped one built from it the way SharingManager.status() reports green contexts on an H200 (two
enforced SM groups, a fixed quota with a term unknown, NVML readings). Each is shown through the app
(Textual pilot) and checked for its numbers; snapshots at 80x24 and 160x48 fix the layout. The recorded
stream the other console tests use has none of these keys: its "not reported" panels are checked there.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import pytest

from console.app import ConsoleApp
from console.screens.dashboard import device_text
from console.screens.partitions import arbiter_content, pct, quotas_content, sm_content
from console.state import ConsoleState
from console.widgets import NOT_REPORTED

CPU_STATUS = json.loads((Path(__file__).parent / "console_fixtures" / "sharing_cpu_status.json").read_text())
SIZES = [(80, 24), (160, 48)]
H200_BYTES = 150_754_820_096  # what torch reports as an H200's total_memory


def cuda_status() -> dict:
    """The recorded status as a daemon on an H200 with green contexts would report it (manager.status())."""
    st = copy.deepcopy(CPU_STATUS)
    st["device"] = {"backend": "cuda", "available": True, "index": 0, "name": "NVIDIA H200",
                    "memory_bytes": H200_BYTES, "num_sms": 132, "compute_capability": [9, 0]}
    summary = "SM partitions: green contexts on cuda:0, disjoint (chat 80 SMs, summarizer 48 SMs; work queues balanced)"
    st["sharing"] = {"name": "green_context", "enforced": True, "summary": summary}
    st["partitions"] = {
        "backend": "green_context", "enforced": True, "summary": summary,
        "hardware": {"name": "h200", "description": "NVIDIA H200", "num_sms": 132, "compute_capability": "9.0",
                     "memory_bytes": H200_BYTES, "mem_bw_bytes_per_s": 4.8e12, "tpc_sms": 2,
                     "min_partition_sms": 8, "alignment_sms": 8, "source": "device+profile"},
        "groups": [{"name": "chat", "models": ["chat"], "share": 0.6, "raw_sms": 79.2, "num_sms": 80},
                   {"name": "batch", "models": ["summarizer"], "share": 0.4, "raw_sms": 52.8, "num_sms": 48}],
        "spare_sms": 4, "time_slice_group": None,
        "warnings": ["quotas add up to 151.2 GB, more than the device's 150.8 GB: the rest wait in the host tier"],
        "error": None}
    chat = {"weights": 3_420_000_000, "kv_peak": 60_000_000_000, "activations": 1_350_000_000,
            "overhead": 536_870_912, "need": 65_306_870_912, "headroom": 0.2, "quota": 78_368_245_094,
            "fixed": False, "sources": {"weights": "store (bfloat16)", "kv_peak": "engine.kv_cache_bytes",
                                        "activations": "estimate", "overhead": "default"},
            "kv_used_bytes": 12_000_000_000, "kv_cap_blocks": None, "used_bytes": 17_306_870_912}
    summarizer = {"weights": 14_000_000_000, "kv_peak": None, "activations": None, "overhead": 536_870_912,
                  "need": None, "headroom": 0.2, "quota": 72_800_000_000, "fixed": True,
                  "sources": {"weights": "config", "overhead": "default"},
                  "kv_used_bytes": 30_500_000_000, "kv_cap_blocks": 29_107, "used_bytes": 45_036_870_912}
    st["quotas"] = {"chat": chat, "summarizer": summarizer}
    st["arbiter"] = {
        "enabled": True, "quantum_ms": 20, "device": "cuda:0", "bandwidth_priority": True,
        "groups": [{"name": "chat", "models": ["chat"], "holder": "chat", "waiting": []},
                   {"name": "batch", "models": ["summarizer"], "holder": "summarizer", "waiting": []}],
        "models": {
            "chat": {"group": "chat", "class": "latency_critical", "share": 0.6, "usage": 0.4213, "duty": 1.0,
                     "num_slices": 812, "num_cut_short": 0, "run_s": 40.1, "wait_s": 0.0, "num_steps": 9120,
                     "throttle_wait_s": 0.0, "decode_step_ms_p50": 11.84, "decode_step_ms_p99": 14.207,
                     "step_target_ms": 12.5},
            "summarizer": {"group": "batch", "class": "best_effort", "share": 0.4, "usage": 0.5531, "duty": 0.35,
                           "num_slices": 640, "num_cut_short": 17, "run_s": 52.3, "wait_s": 0.9125,
                           "num_steps": 2410, "throttle_wait_s": 18.2, "decode_step_ms_p50": 21.4,
                           "decode_step_ms_p99": 38.02, "step_target_ms": None}},
        "num_switches": 0, "switch_s": 0.0, "overhead_share": 0.0, "num_throttle_changes": 23}
    readings = st["device"].setdefault("readings", copy.deepcopy(CPU_STATUS["device"]["readings"]))
    readings.update({"device": "cuda:0", "source": ["nvml", "nvml-gpm", "psutil"], "unavailable": {},
                     "sm_util_pct": 97.0, "mem_util_pct": 41.0, "sm_active_pct": 71.5, "mem_bw_util_pct": 48.2,
                     "sm_occupancy_pct": 33.0, "tensor_active_pct": 22.0, "mem_used_bytes": 98_300_000_000,
                     "mem_total_bytes": H200_BYTES, "temperature_c": 61, "power_w": 512.4, "health": "ok",
                     "health_reasons": [], "xid_errors_total": 0, "last_xid": None, "throttle_reasons": [],
                     "cpu_util_pct": 23.5, "process_rss_bytes": 6_100_000_000})
    for m, (name, cls, group, sms) in zip(st["models"], [("chat", "latency_critical", "chat", 80),
                                                         ("summarizer", "best_effort", "batch", 48)]):
        m.update(name=name, device="cuda:0", sharing_class=cls, sharing_group=group, num_sms=sms)
    return st


class StaticFeed:
    """One status, read-only, with a fixed name in the header (the snapshots must not hold a path)."""

    def __init__(self, state: ConsoleState, status: dict, where: str):
        self.state, self.status, self.where = state, status, where

    async def run(self) -> None:
        self.state.clock = lambda: self.status["device"].get("readings", {}).get("t", 0.0)
        self.state.set_status(self.status)
        self.state.set_connection("replay", self.where, "read-only", pid=self.status.get("pid"))


def app_for(status: dict, where: str, start: str = "partitions") -> ConsoleApp:
    return ConsoleApp(lambda state: StaticFeed(state, status, where), start=start)


def text(app, selector: str) -> str:
    """What a panel shows, as plain text (its renderable rendered at the panel's width)."""
    from rich.console import Console

    panel = app.screen.query_one(selector)
    console = Console(width=panel.content_size.width or 76, no_color=True, record=True, file=io.StringIO())
    console.print(panel.content)
    return console.export_text()


async def settle(app, pilot) -> None:
    await app.workers.wait_for_complete()
    app.tick()
    await pilot.pause()


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.mark.anyio
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_cpu_time_slices_and_the_arbiter(size):
    app = app_for(CPU_STATUS, "sharing-cpu")
    async with app.run_test(size=size) as pilot:
        await settle(app, pilot)
        sm = text(app, "#sm")
        assert "SM partitions: not enforced (no CUDA device)" in sm
        assert "every model shares the whole device (group device: tiny, tiny2)" in sm
        assert "hardware" not in sm and "spare" not in sm and NOT_REPORTED not in sm
        quotas = text(app, "#quotas")
        assert "MB; quota = need x 1.20" in quotas and "activations estimated" in quotas
        # tiny: 608000 B weights, 4194304 KV peak, 3964928 activations, 0 overhead, quota 10520679, in use 4572928
        assert " 0.6 " in quotas and " 4.2 " in quotas and " 4.0 " in quotas and " 10.5 " in quotas
        assert " 4.6 " in quotas and " 5.2 " in quotas  # tiny2 holds 614400 B of KV on top: 5187328
        arb = text(app, "#arbiter")
        assert "quantum 10 ms on cpu; bandwidth priority on (3 throttle changes)" in arb
        assert "3 switches, 3.6 ms switching: 0.15% of the time" in arb
        assert "group device: tiny, tiny2; held by tiny2" in arb
        rows = [line.split() for line in arb.splitlines() if line.startswith(("tiny ", "tiny2 "))]
        tiny = ["tiny", "latency_critical", "device", "60%", "14%", "100%", "2", "0", "0.03", "1.8", "4.4", "4.0"]
        tiny2 = ["tiny2", "best_effort", "device", "40%", "19%", "68%", "164", "0", "1.06", "2.3", "21.8", "4.0"]
        if size[0] >= 120:  # one table
            assert rows == [tiny, tiny2]
        else:  # two: shares, then slices and decode steps
            assert rows == [tiny[:6], tiny2[:6], tiny[:1] + tiny[6:], tiny2[:1] + tiny2[6:]]
        await pilot.press("1")
        await pilot.pause()
        dev = " ".join(text(app, "#device").split())
        assert "device readings unavailable: no CUDA device" in dev
        assert "CPU 85%" in dev and "RSS 1.3 GiB" in dev
        assert "sm_util_pct" not in dev and "None" not in dev


@pytest.mark.anyio
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
async def test_cuda_groups_quotas_and_two_arbiter_groups(size):
    app = app_for(cuda_status(), "sharing-cuda")
    async with app.run_test(size=size) as pilot:
        await settle(app, pilot)
        sm = text(app, "#sm")
        assert sm.startswith("SM partitions: green contexts on cuda:0, disjoint")
        assert ("hardware h200 (NVIDIA H200): 132 SMs, compute capability 9.0, 150.8 GB, 4.80 TB/s"
                in " ".join(sm.split()))
        lines = {line.split()[0]: line.split() for line in sm.splitlines() if line.strip()}
        assert lines["chat"] == ["chat", "60%", "79.2", "80", "chat"]
        assert lines["batch"] == ["batch", "40%", "52.8", "48", "summarizer"]
        assert lines["spare"] == ["spare", "4", "(elastic", "buffer)"]
        assert "time slices" not in sm and "not enforced" not in sm
        assert "warning: quotas add up to 151.2 GB" in " ".join(sm.split())
        quotas = text(app, "#quotas")
        assert quotas.startswith("GB; quota = need x 1.20")
        assert "* fixed by memory_quota_bytes" in " ".join(quotas.split())
        rows = {line.split()[0]: line.split() for line in quotas.splitlines() if line.startswith(("chat", "summ"))}
        assert rows["chat"] == ["chat", "3.4", "60.0", "1.4", "0.5", "78.4", "17.3", "-"]
        assert rows["summarizer"] == ["summarizer", "14.0", "-", "-", "0.5", "72.8*", "45.0", "29107"]
        arb = text(app, "#arbiter")
        assert "quantum 20 ms on cuda:0; bandwidth priority on (23 throttle changes)" in arb
        assert "0 switches, 0.00 ms switching: 0% of the time" in arb
        assert "group chat: chat; held by chat" in arb and "group batch: summarizer; held by summarizer" in arb
        rows = [line.split() for line in arb.splitlines() if line.startswith(("chat ", "summarizer "))]
        chat = ["chat", "latency_critical", "chat", "60%", "42%", "100%", "812", "0", "0.00", "11.8", "14.2", "12.5"]
        summ = ["summarizer", "best_effort", "batch", "40%", "55%", "35%", "640", "17", "0.91", "21.4", "38.0", "-"]
        if size[0] >= 120:
            assert rows == [chat, summ]
        else:
            assert rows == [chat[:6], summ[:6], chat[:1] + chat[6:], summ[:1] + summ[6:]]
        await pilot.press("1")
        await pilot.pause()
        lines = text(app, "#device").splitlines()
        dev = " ".join(" ".join(lines).split())
        assert dev.startswith("cuda: NVIDIA H200")
        assert "SM 97% (active 72%) mem BW 48% mem 91.5/140.4 GiB health ok Xid 0 61°C 512 W" in dev
        assert "CPU 24%" in dev and "RSS 5.7 GiB" in dev and "unavailable" not in dev
        assert "health ok  Xid 0" in "\n".join(lines[:3])  # within a narrow panel's three lines


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("status", ["cpu", "cuda"])
def test_partitions_layout(snap_compare, status, size):
    st = CPU_STATUS if status == "cpu" else cuda_status()

    async def run_before(pilot) -> None:
        await settle(pilot.app, pilot)

    assert snap_compare(app_for(st, f"sharing-{status}"), terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("status", ["cpu", "cuda"])
def test_dashboard_device_panel_layout(snap_compare, status):
    """The Device panel's three lines at 80x24: the reading packed by field, or why there is none."""
    st = CPU_STATUS if status == "cpu" else cuda_status()

    async def run_before(pilot) -> None:
        await settle(pilot.app, pilot)

    assert snap_compare(app_for(st, f"sharing-{status}", start="dashboard"), terminal_size=(80, 24),
                        run_before=run_before)


# ---- the pieces, without the app --------------------------------------------------------------------

def plain(renderable, width: int = 76) -> str:
    from rich.console import Console

    console = Console(width=width, no_color=True, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def test_absent_sections_say_not_reported_as_before():
    st = {"device": {"backend": "cpu", "name": "x86_64"}}
    assert sm_content(st) == f"partitions: {NOT_REPORTED}\n(device is a CPU: SM partitions do not apply)"
    assert sm_content({"device": {"backend": "cuda", "name": "A100", "num_sms": 108}}) == \
        f"partitions: {NOT_REPORTED}\nA100: 108 SMs in one group"
    assert quotas_content(st) == f"quotas: {NOT_REPORTED}"
    assert arbiter_content(st) == f"arbiter: {NOT_REPORTED}"


def test_disabled_arbiter_no_quotas_a_plan_error_and_a_degraded_device():
    st = copy.deepcopy(CPU_STATUS)
    st["arbiter"] = {"enabled": False, "reason": "sharing.enabled is false: models step whenever they have work"}
    st["quotas"] = {}
    st["partitions"]["error"] = "3 SM groups need at least 3 x 8 = 24 SMs but the device has 16"
    assert plain(arbiter_content(st)).strip() == \
        "arbiter off: sharing.enabled is false: models step whenever they have work"
    assert plain(quotas_content(st)).strip() == "no quotas: no model is planned"
    assert "plan error: 3 SM groups need" in plain(sm_content(st))
    cuda = cuda_status()
    cuda["device"]["readings"].update(health="degraded", health_reasons=["hw_thermal"], xid_errors_total=2,
                                      last_xid=79, mem_bw_util_pct=None, sm_active_pct=None,
                                      throttle_reasons=["hw_thermal"])
    state = ConsoleState()
    state.set_status(cuda)
    dev = device_text(state, 200)
    assert "SM 97%  mem 91.5/140.4 GiB" in dev and "BW" not in dev
    assert "health degraded (hw_thermal)  Xid 2 (last 79)  throttled: hw_thermal" in dev


def test_percentages_keep_small_shares_readable():
    assert [pct(x) for x in (None, 0, 0.000637, 0.045, 0.6, 1.0)] == ["-", "0%", "0.06%", "4.5%", "60%", "100%"]


def test_a_plan_no_backend_enforces_is_shown_as_planned_and_time_sliced():
    st = cuda_status()
    summary = "SM partitions: not enforced (green contexts: the CUDA driver is older than 12.4; MPS: no MPS " \
              "control daemon (no pipe at /tmp/nvidia-mps/control, no nvidia-cuda-mps-control process))"
    st["partitions"].update(backend="none", enforced=False, summary=summary, time_slice_group="device", warnings=[])
    st["arbiter"]["groups"] = [{"name": "device", "models": ["chat", "summarizer"], "holder": None, "waiting": []}]
    out = " ".join(plain(sm_content(st), 120).split())
    assert out.startswith("SM partitions: not enforced (green contexts: the CUDA driver is older than 12.4; MPS:")
    assert "planned SM groups (not enforced by backend none): group share ideal SMs models chat 60% 79.2 80 chat" in out
    assert out.endswith("time slices: every model shares the whole device (group device: chat, summarizer)")

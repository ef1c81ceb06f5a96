"""Device readings: on this CPU machine (every device field None with a reason), and the NVML code path
driven by a stand-in pynvml module. The stand-in tests our parsing, our state (the GPM pair, Xid counts,
queries not asked again) and our error handling; it is never a reading."""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace

import pynvml
import pytest
import torch

from gpuservd.gpu import nvml as nvml_mod
from gpuservd.gpu.readings import DEVICE_FIELDS, HOST_FIELDS, NO_CUDA, DeviceReader

IDENT = {"index": 0, "name": "Stand-in H100", "uuid": "1234abcd-0000-1111-2222-333344445555"}


def ident(_index):
    return dict(IDENT)


# ---- this machine: no CUDA ---------------------------------------------------------------------------
def check_shape(r: dict) -> None:
    for f in DEVICE_FIELDS + HOST_FIELDS + ("t", "device", "source", "unavailable", "read_ms"):
        assert f in r, f
    json.dumps(r)  # JSON-ready as it is
    for f, v in r.items():
        if f == "last_xid" and r["xid_errors_total"] is not None:
            continue  # None = no Xid since start: a value, not a gap
        if f in DEVICE_FIELDS + HOST_FIELDS and v is None:
            assert r["unavailable"].get(f), f"{f} is None without a reason"


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_device_fields_on_this_machine(device):
    """cpu, and cuda:0 on a machine without CUDA (CI): every device field None with the reason. cuda:0 on
    a GPU machine: the device is read (NVML where nvidia-ml-py is there), and every field is a value or
    has a reason."""
    reader = DeviceReader(device)  # asks the real torch
    r = reader.read()
    check_shape(r)
    if device != "cpu" and torch.cuda.is_available():
        assert reader.available and reader.reason is None
        assert "psutil" in r["source"]
        if "nvml" in r["source"]:
            assert r["mem_total_bytes"] > 0 and r["mem_total_bytes"] >= r["mem_used_bytes"] >= 0
        else:
            assert r["mem_total_bytes"] is None and r["unavailable"]["mem_total_bytes"]  # NVML said why not
        reader.close()
        return
    assert not reader.available and reader.reason == NO_CUDA
    for f in DEVICE_FIELDS:
        assert r[f] is None and r["unavailable"][f] == NO_CUDA
    assert r["source"] == ["psutil"]
    assert r["host_mem_total_bytes"] > r["host_mem_used_bytes"] > 0
    assert 0 < r["process_rss_bytes"] < r["host_mem_total_bytes"]
    sum(i * i for i in range(300_000))  # some CPU time, so the next read has an interval to measure
    time.sleep(0.05)
    r2 = reader.read()
    assert 0.0 <= r2["cpu_util_pct"] <= 100.0
    assert reader.info()["unavailable_reason"] == NO_CUDA
    reader.close()


def test_without_nvidia_ml_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    r = DeviceReader("cuda:0", identity=ident).read()
    assert {r["unavailable"][f] for f in DEVICE_FIELDS} == {"nvidia-ml-py not installed"}


def test_nvml_init_failure_is_a_reason():
    fake = FakeNvml(fail={"nvmlInit": pynvml.NVML_ERROR_LIBRARY_NOT_FOUND})
    reader = DeviceReader("cuda:0", nvml=fake, identity=ident)
    assert reader.reason == "NVML init failed: NVML Shared Library Not Found"
    r = reader.read()
    check_shape(r)
    assert r["health"] is None and r["unavailable"]["health"].startswith("NVML init failed")


# ---- the NVML path, through a stand-in module -----------------------------------------------------------
class MetricsGet:
    """Shaped like pynvml.c_nvmlGpmMetricsGet_t."""

    def __init__(self):
        self.version = self.numMetrics = 0
        self.sample1 = self.sample2 = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(32)]


class FakeNvml:
    """The parts of pynvml the reader calls, with pynvml's own constants and error classes."""

    NVMLError = pynvml.NVMLError
    c_nvmlGpmMetricsGet_t = MetricsGet

    def __init__(self, gpm=True, fail=None, events=True):
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType", "nvmlClocksEventReason", "nvmlClocksThrottleReason")):
                setattr(self, name, getattr(pynvml, name))
        self.gpm, self.fail, self.events_ok = gpm, dict(fail or {}), events
        self.calls: dict[str, int] = {}
        self.xids: list[int] = []
        self.throttle = 0
        self.pages_pending = pynvml.NVML_FEATURE_DISABLED
        self.rows = (0, 0, 0, 0)
        self.tick = 0
        self.handle_by = None

    def _call(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in self.fail:
            err = self.fail[name]
            raise err if isinstance(err, Exception) else pynvml.NVMLError(err)

    def nvmlInit(self):
        self._call("nvmlInit")

    def nvmlShutdown(self):
        self._call("nvmlShutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self._call("nvmlDeviceGetHandleByUUID")
        self.handle_by = uuid
        return "handle"

    def nvmlDeviceGetHandleByIndex(self, index):
        self._call("nvmlDeviceGetHandleByIndex")
        self.handle_by = index
        return "handle"

    def nvmlDeviceGetUtilizationRates(self, h):
        self._call("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=87, memory=41)

    def nvmlDeviceGetMemoryInfo(self, h):
        self._call("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=80 * 2**30, free=30 * 2**30, used=50 * 2**30)

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._call("nvmlDeviceGetTemperature")
        return 61

    def nvmlDeviceGetPowerUsage(self, h):
        self._call("nvmlDeviceGetPowerUsage")
        return 412_500  # mW

    def nvmlDeviceGetClockInfo(self, h, kind):
        self._call("nvmlDeviceGetClockInfo")
        return 1980 if kind == pynvml.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self._call("nvmlDeviceGetCurrentClocksEventReasons")
        return self.throttle

    def nvmlDeviceGetPcieThroughput(self, h, counter):
        self._call("nvmlDeviceGetPcieThroughput")
        return 1000 if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES else 3000  # KB/s

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        self._call("nvmlDeviceGetRetiredPagesPendingStatus")
        return self.pages_pending

    def nvmlDeviceGetRemappedRows(self, h):
        self._call("nvmlDeviceGetRemappedRows")
        return self.rows

    # GPM: a sample is a tick; a metric is right only when sample1 is the older one
    def nvmlGpmQueryDeviceSupport(self, h):
        self._call("nvmlGpmQueryDeviceSupport")
        return SimpleNamespace(isSupportedDevice=int(self.gpm))

    def nvmlGpmSampleAlloc(self):
        self._call("nvmlGpmSampleAlloc")
        return SimpleNamespace(tick=None)

    def nvmlGpmSampleFree(self, s):
        self._call("nvmlGpmSampleFree")

    def nvmlGpmSampleGet(self, h, s):
        self._call("nvmlGpmSampleGet")
        self.tick += 1
        s.tick = self.tick
        return s

    def nvmlGpmMetricsGet(self, mg):
        self._call("nvmlGpmMetricsGet")
        assert mg.version == pynvml.NVML_GPM_METRICS_GET_VERSION
        ordered = mg.sample1.tick < mg.sample2.tick
        for m in mg.metrics[: mg.numMetrics]:
            if m.metricId == pynvml.NVML_GPM_METRIC_SM_OCCUPANCY:
                m.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
            else:
                m.value = {pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: 73.5, pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: 2.0,
                           pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: 8.0}.get(m.metricId, 25.0) if ordered else -1.0
        return mg

    # Xid events
    def nvmlDeviceGetSupportedEventTypes(self, h):
        self._call("nvmlDeviceGetSupportedEventTypes")
        return pynvml.nvmlEventTypeAll if self.events_ok else 0

    def nvmlEventSetCreate(self):
        self._call("nvmlEventSetCreate")
        return "eventset"

    def nvmlDeviceRegisterEvents(self, h, types, es):
        self._call("nvmlDeviceRegisterEvents")
        assert types == pynvml.nvmlEventTypeXidCriticalError

    def nvmlEventSetWait_v2(self, es, timeout_ms):
        self._call("nvmlEventSetWait_v2")
        assert timeout_ms == 0  # a read never waits
        if not self.xids:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=self.xids.pop(0))

    def nvmlEventSetFree(self, es):
        self._call("nvmlEventSetFree")

    # info()
    def nvmlDeviceGetName(self, h):
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h):
        return "GPU-" + IDENT["uuid"]

    def nvmlSystemGetDriverVersion(self):
        return "580.159.03"

    def nvmlSystemGetCudaDriverVersion(self):
        return 13000

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)


def reader_with(fake: FakeNvml) -> DeviceReader:
    reader = DeviceReader("cuda:0", nvml=fake, identity=ident)
    assert reader.available, reader.reason
    return reader


def test_nvml_fields_units_and_sources():
    fake = FakeNvml()
    reader = reader_with(fake)
    assert fake.handle_by == "GPU-" + IDENT["uuid"]  # found by UUID: CUDA's and NVML's indices can differ
    r = reader.read()
    check_shape(r)
    assert r["source"] == ["nvml", "nvml-gpm", "psutil"]
    assert (r["sm_util_pct"], r["mem_util_pct"]) == (87.0, 41.0)
    assert (r["mem_used_bytes"], r["mem_total_bytes"]) == (50 * 2**30, 80 * 2**30)
    assert (r["temperature_c"], r["power_w"]) == (61.0, 412.5)
    assert (r["sm_clock_mhz"], r["mem_clock_mhz"]) == (1980, 2619)
    assert r["throttle_reasons"] == [] and r["health"] == "ok" and r["health_reasons"] == []
    assert r["xid_errors_total"] == 0 and r["last_xid"] is None and "last_xid" not in r["unavailable"]
    # GPM needs a pair: the first read has none of its fields, and the legacy PCIe query is not used
    assert r["mem_bw_util_pct"] is None and "two samples" in r["unavailable"]["mem_bw_util_pct"]
    assert "nvmlDeviceGetPcieThroughput" not in fake.calls
    r = reader.read()
    assert r["mem_bw_util_pct"] == 73.5 and r["sm_active_pct"] == 25.0 and r["tensor_active_pct"] == 25.0
    assert (r["pcie_tx_bytes_per_s"], r["pcie_rx_bytes_per_s"]) == (2.0 * 2**20, 8.0 * 2**20)  # MiB/s
    assert r["sm_occupancy_pct"] is None and "GPM metric" in r["unavailable"]["sm_occupancy_pct"]
    for _ in range(3):  # the pair keeps turning over: every later read is ordered older -> newer
        assert reader.read()["mem_bw_util_pct"] == 73.5
    info = reader.info()
    assert info["compute_capability"] == "9.0" and info["cuda_driver_version"] == "13.0"
    assert info["gpm"] == "supported" and info["xid_events"] == "registered"
    reader.close()
    assert fake.calls["nvmlGpmSampleFree"] == 2 and fake.calls["nvmlEventSetFree"] == 1
    assert fake.calls["nvmlShutdown"] == 1


def test_without_gpm_the_legacy_pcie_counters():
    fake = FakeNvml(gpm=False)
    r = reader_with(fake).read()
    assert r["source"] == ["nvml", "psutil"]
    assert (r["pcie_tx_bytes_per_s"], r["pcie_rx_bytes_per_s"]) == (1000 * 1024.0, 3000 * 1024.0)  # KB/s
    assert r["mem_bw_util_pct"] is None and "Hopper" in r["unavailable"]["mem_bw_util_pct"]


def test_xid_events_counted_and_health():
    fake = FakeNvml()
    reader = reader_with(fake)
    now = [1000.0]
    reader._nvml.clock = lambda: now[0]
    assert reader.read()["health"] == "ok"
    fake.xids = [31, 13]
    r = reader.read()
    assert (r["xid_errors_total"], r["last_xid"]) == (2, 13)
    assert r["health"] == "degraded" and r["health_reasons"] == ["Xid 13, 31 in the last 5 min"]
    now[0] += nvml_mod.XID_DEGRADED_S + 1  # an application's Xid ages out; the count stays
    r = reader.read()
    assert r["health"] == "ok" and r["xid_errors_total"] == 2
    fake.xids = [79]
    r = reader.read()
    assert r["health"] == "failed" and r["health_reasons"] == ["Xid 79 (GPU has fallen off the bus)"]
    assert r["xid_errors_total"] == 3 and r["last_xid"] == 79


def test_xid_events_unsupported_is_a_reason():
    r = reader_with(FakeNvml(events=False)).read()
    assert r["xid_errors_total"] is None and r["unavailable"]["xid_errors_total"] == \
        "Xid events not supported on this device"
    assert r["health"] == "ok"  # clock reasons and retired pages were readable


def test_health_from_throttle_and_pages():
    fake = FakeNvml()
    reader = reader_with(fake)
    fake.throttle = pynvml.nvmlClocksEventReasonSwPowerCap  # at its power limit under load: normal
    r = reader.read()
    assert r["throttle_reasons"] == ["sw_power_cap"] and r["health"] == "ok"
    fake.throttle |= pynvml.nvmlClocksEventReasonHwThermalSlowdown
    r = reader.read()
    assert r["health"] == "degraded" and r["health_reasons"] == ["clocks slowed: hw_thermal"]
    fake.throttle = 0
    fake.pages_pending = pynvml.NVML_FEATURE_ENABLED
    reader._nvml._slow_at = float("-inf")  # the slow checks run every 30 s
    assert "retired pages pending" in reader.read()["health_reasons"][0]
    fake.rows = (0, 0, 0, 1)
    reader._nvml._slow_at = float("-inf")
    r = reader.read()
    assert r["health"] == "failed" and r["health_reasons"][0].startswith("row remapping failed")


def test_errors_become_reasons_and_unsupported_queries_are_not_repeated():
    fake = FakeNvml(fail={"nvmlDeviceGetPowerUsage": pynvml.NVML_ERROR_NOT_SUPPORTED,
                          "nvmlDeviceGetTemperature": pynvml.NVML_ERROR_UNKNOWN,
                          "nvmlDeviceGetMemoryInfo": ValueError("bad struct")})
    reader = reader_with(fake)
    for _ in range(3):
        r = reader.read()
        check_shape(r)
        assert r["power_w"] is None and r["unavailable"]["power_w"] == "nvmlDeviceGetPowerUsage: Not Supported"
        assert r["temperature_c"] is None and r["unavailable"]["temperature_c"] == \
            "nvmlDeviceGetTemperature: Unknown Error"
        assert r["mem_used_bytes"] is None and "bad struct" in r["unavailable"]["mem_used_bytes"]
        assert r["sm_util_pct"] == 87.0  # the rest still reads
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 1  # Not Supported does not change: not asked again
    assert fake.calls["nvmlDeviceGetTemperature"] == 3  # an unknown error may pass: asked every read


def test_gpu_lost_is_failed_health():
    fake = FakeNvml(fail={"nvmlDeviceGetUtilizationRates": pynvml.NVML_ERROR_GPU_IS_LOST})
    r = reader_with(fake).read()
    assert r["health"] == "failed" and r["health_reasons"][0] == "nvmlDeviceGetUtilizationRates: GPU is lost"


def test_no_health_input_means_no_health_word():
    fake = FakeNvml(events=False, fail={n: pynvml.NVML_ERROR_NO_PERMISSION for n in (
        "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetRemappedRows")})
    r = reader_with(fake).read()
    assert r["health"] is None and "no health input" in r["unavailable"]["health"]


def test_read_never_raises(monkeypatch):
    reader = reader_with(FakeNvml())

    def broken(self, values, unavailable):
        raise KeyError("parsing bug")

    monkeypatch.setattr(nvml_mod.NvmlDevice, "read", broken)
    r = reader.read()
    check_shape(r)
    assert all(r[f] is None for f in DEVICE_FIELDS)
    assert r["unavailable"]["sm_util_pct"].startswith("reading failed: KeyError")
    assert r["host_mem_total_bytes"] > 0


def test_handle_falls_back_to_index_and_reports_a_missing_device():
    fake = FakeNvml(fail={"nvmlDeviceGetHandleByUUID": pynvml.NVML_ERROR_NOT_FOUND})
    reader = reader_with(fake)
    assert fake.handle_by == 0 and reader.info()["nvml_handle_by"] == "index"
    fake = FakeNvml(fail={"nvmlDeviceGetHandleByUUID": pynvml.NVML_ERROR_NOT_FOUND,
                          "nvmlDeviceGetHandleByIndex": pynvml.NVML_ERROR_INVALID_ARGUMENT})
    reader = DeviceReader("cuda:0", nvml=fake, identity=ident)
    assert not reader.available and reader.reason.startswith("NVML has no handle for this CUDA device")
    assert fake.calls["nvmlShutdown"] == 1


def test_phase_sampler_medians_and_reasons():
    """A benchmark phase's clocks and load: medians of the readings taken while it ran; a field never
    read comes back null with its reason (never 0)."""
    import time as _time

    from gpuservd.gpu.readings import PhaseSampler

    fake = FakeNvml()
    with PhaseSampler(reader_with(fake), interval_s=0.01) as s:
        _time.sleep(0.08)
    out = s.summary()
    assert out["samples"] >= 2 and out["sm_clock_mhz"] == 1980 and out["power_w"] is not None
    with PhaseSampler(DeviceReader("cpu"), interval_s=0.01) as s:
        _time.sleep(0.03)
    out = s.summary()
    assert out["sm_clock_mhz"] is None and out["unavailable"]["sm_clock_mhz"] == NO_CUDA

"""NVML readings of one CUDA device (through `pynvml`, the module of the nvidia-ml-py package).

`NvmlDevice.read(values, unavailable)` fills the device fields of a reading
(`readings.DEVICE_FIELDS`). Every call is one NVML query of a few microseconds,
except on devices without GPM, where the PCIe counters come from
`nvmlDeviceGetPcieThroughput`, which samples a byte counter over 20 ms (two
calls: ~40 ms, still fine for a once-a-second reader thread). Slow-changing
health inputs (retired pages, remapped rows) are read every `SLOW_EVERY_S`.

A field that cannot be read is None and `unavailable[field]` says why (the NVML
call and its error). A query that answers Not Supported / No Permission /
Function Not Found is not asked again: that answer does not change while the
process lives. Nothing here raises out of `read()`.
"""

from __future__ import annotations

import time

# GPM (GPU performance monitoring, Hopper and newer): metric name in pynvml -> (our field, scale to our unit)
GPM_METRICS = (
    ("NVML_GPM_METRIC_SM_UTIL", "sm_active_pct", 1.0),  # share of SMs busy, averaged over the interval
    ("NVML_GPM_METRIC_SM_OCCUPANCY", "sm_occupancy_pct", 1.0),  # resident warps / the maximum
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", "mem_bw_util_pct", 1.0),  # HBM bandwidth used / peak (the arbiter's bandwidth priority reads it)
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "tensor_active_pct", 1.0),
    ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", "pcie_tx_bytes_per_s", float(2**20)),  # GPM gives MiB/s
    ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", "pcie_rx_bytes_per_s", float(2**20)),
)

# Clock event ("throttle") reasons: pynvml suffix -> our name; True = the hardware is protecting itself (degraded)
THROTTLE_REASONS = (
    ("GpuIdle", "idle", False),
    ("ApplicationsClocksSetting", "app_clocks", False),
    ("SwPowerCap", "sw_power_cap", False),  # normal at full load: the board runs at its power limit
    ("HwSlowdown", "hw_slowdown", True),
    ("SyncBoost", "sync_boost", False),
    ("SwThermalSlowdown", "sw_thermal", True),
    ("HwThermalSlowdown", "hw_thermal", True),
    ("HwPowerBrakeSlowdown", "hw_power_brake", True),
    ("DisplayClockSetting", "display_clock", False),
)

# Xids that mean the device itself failed (NVIDIA's Xid catalogue); any other Xid (13, 31, 43: often an
# application's fault) makes health "degraded" for XID_DEGRADED_S.
FATAL_XIDS = {48: "double-bit ECC error", 64: "ECC page retirement / row remapping failure",
              79: "GPU has fallen off the bus", 95: "uncontained ECC error", 119: "GSP RPC timeout",
              120: "GSP error"}
XID_DEGRADED_S = 300.0
SLOW_EVERY_S = 30.0
XID_POLL_MAX = 64  # events drained per read (more wait for the next read)


class NvmlUnavailable(Exception):
    """NVML cannot read this device; the message is the reason shown in `unavailable`."""


def _text(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _codes(nvml, *names: str) -> set:
    return {getattr(nvml, n) for n in names if hasattr(nvml, n)}


class NvmlDevice:
    """One device's NVML state: the handle, the GPM samples (the previous one is kept: a GPM metric is the
    difference of two), the Xid event set and its counts, and the queries known to be unsupported."""

    def __init__(self, nvml, handle, how: str, clock=time.monotonic):
        self.nvml = nvml
        self.handle = handle
        self.how = how  # how the handle was found: "uuid" | "pci_bus_id" | "index"
        self.clock = clock
        self._skip: dict[str, str] = {}  # query -> reason it will not answer
        self._persistent = _codes(nvml, "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_NO_PERMISSION",
                                  "NVML_ERROR_FUNCTION_NOT_FOUND")
        self._lost_codes = _codes(nvml, "NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED")
        self._lost: str | None = None  # this read saw "GPU is lost" / "reset required"
        self.xid_errors_total = 0
        self.last_xid: int | None = None
        self._xid_times: list[tuple[float, int]] = []  # (when, xid) of recent non-fatal Xids
        self._fatal_xids: dict[int, str] = {}
        self._slow_at = float("-inf")
        self._slow: dict = {}
        self._gpm_samples: list = []
        self._gpm_prev = None
        self._gpm_reason: str | None = None
        self._events = None
        self._xid_reason: str | None = None
        self._setup_gpm()
        self._setup_xid()

    @classmethod
    def open(cls, nvml, identity: dict) -> NvmlDevice:
        """nvmlInit, then the handle of the CUDA device `identity` describes (uuid, pci_bus_id, index)."""
        try:
            nvml.nvmlInit()
        except Exception as exc:
            raise NvmlUnavailable(f"NVML init failed: {_text(exc)}") from None
        tries = []
        if identity.get("uuid"):
            uuid = str(identity["uuid"])
            tries.append(("uuid", lambda: nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-"))
                                                                          else "GPU-" + uuid)))
        if identity.get("pci_bus_id"):
            tries.append(("pci_bus_id", lambda: nvml.nvmlDeviceGetHandleByPciBusId(identity["pci_bus_id"])))
        if identity.get("index") is not None:
            # NVML numbers devices in PCI order, CUDA fastest first and after CUDA_VISIBLE_DEVICES: last resort
            tries.append(("index", lambda: nvml.nvmlDeviceGetHandleByIndex(int(identity["index"]))))
        errors = []
        for how, get in tries:
            try:
                return cls(nvml, get(), how)
            except Exception as exc:
                errors.append(f"by {how}: {_text(exc)}")
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
        raise NvmlUnavailable("NVML has no handle for this CUDA device (" + "; ".join(errors or ["no identity"]) + ")")

    # ---- setup ------------------------------------------------------------------------------------
    def _setup_gpm(self) -> None:
        n = self.nvml
        try:
            if not n.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice:
                self._gpm_reason = "GPM not supported on this device (Hopper or newer has it)"
                return
            self._gpm_samples = [n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()]
            self._gpm_ids = [(getattr(n, name), field, scale) for name, field, scale in GPM_METRICS
                             if hasattr(n, name)]
        except Exception as exc:
            self._gpm_reason = f"GPM: {_text(exc)}"
            self._gpm_samples = []

    def _setup_xid(self) -> None:
        n = self.nvml
        xid = getattr(n, "nvmlEventTypeXidCriticalError", 0x8)
        try:
            supported = n.nvmlDeviceGetSupportedEventTypes(self.handle)
            if not supported & xid:
                self._xid_reason = "Xid events not supported on this device"
                return
            self._events = n.nvmlEventSetCreate()
            n.nvmlDeviceRegisterEvents(self.handle, xid, self._events)
        except Exception as exc:
            self._xid_reason = f"Xid events: {_text(exc)}"
            self._free_events()

    def _free_events(self) -> None:
        """Release the Xid event set (if any); a failure to free it is not worth a reading."""
        if self._events is not None:
            try:
                self.nvml.nvmlEventSetFree(self._events)
            except Exception:
                pass
        self._events = None

    # ---- one read ---------------------------------------------------------------------------------
    def _group(self, name: str, fields: tuple, fn, values: dict, unavailable: dict) -> bool:
        """Run one query; on failure its fields are None with the reason. True when it answered."""
        if name in self._skip:
            for f in fields:
                values[f] = None
                unavailable[f] = self._skip[name]
            return False
        try:
            values.update(fn())
            return True
        except Exception as exc:
            reason = f"{name}: {_text(exc)}"
            code = getattr(exc, "value", None)
            if code in self._persistent:
                self._skip[name] = reason
            if code in self._lost_codes:
                self._lost = reason
            for f in fields:
                values[f] = None
                unavailable[f] = reason
            return False

    def read(self, values: dict, unavailable: dict) -> None:
        n, h = self.nvml, self.handle
        self._lost = None

        def util():
            u = n.nvmlDeviceGetUtilizationRates(h)
            return {"sm_util_pct": float(u.gpu), "mem_util_pct": float(u.memory)}

        def memory():
            m = n.nvmlDeviceGetMemoryInfo(h)
            return {"mem_used_bytes": int(m.used), "mem_total_bytes": int(m.total)}

        def clocks():
            return {"sm_clock_mhz": int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM)),
                    "mem_clock_mhz": int(n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))}

        self._group("nvmlDeviceGetUtilizationRates", ("sm_util_pct", "mem_util_pct"), util, values, unavailable)
        self._group("nvmlDeviceGetMemoryInfo", ("mem_used_bytes", "mem_total_bytes"), memory, values, unavailable)
        self._group("nvmlDeviceGetTemperature", ("temperature_c",),
                    lambda: {"temperature_c": float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))},
                    values, unavailable)
        self._group("nvmlDeviceGetPowerUsage", ("power_w",),
                    lambda: {"power_w": n.nvmlDeviceGetPowerUsage(h) / 1000.0}, values, unavailable)  # mW
        self._group("nvmlDeviceGetClockInfo", ("sm_clock_mhz", "mem_clock_mhz"), clocks, values, unavailable)
        throttled = self._read_throttle(values, unavailable)
        self._read_gpm(values, unavailable)
        if not self._gpm_samples:  # no GPM: the legacy PCIe counters (20 ms each)
            def pcie():  # NVML answers KB/s
                return {"pcie_tx_bytes_per_s": 1024.0 * n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_TX_BYTES),
                        "pcie_rx_bytes_per_s": 1024.0 * n.nvmlDeviceGetPcieThroughput(h, n.NVML_PCIE_UTIL_RX_BYTES)}
            self._group("nvmlDeviceGetPcieThroughput", ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s"), pcie,
                        values, unavailable)
        self._read_xid(values, unavailable)
        self._read_health(values, unavailable, throttled)

    def _read_throttle(self, values: dict, unavailable: dict) -> list[str] | None:
        n, h = self.nvml, self.handle

        def reasons():
            get = getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                n.nvmlDeviceGetCurrentClocksThrottleReasons  # the older name (drivers before 535)
            bits = int(get(h))
            names = []
            for suffix, name, _ in THROTTLE_REASONS:
                mask = getattr(n, "nvmlClocksEventReason" + suffix, None) or \
                    getattr(n, "nvmlClocksThrottleReason" + suffix, 0)
                if mask and bits & mask:
                    names.append(name)
            return {"throttle_reasons": names}

        ok = self._group("nvmlDeviceGetCurrentClocksEventReasons", ("throttle_reasons",), reasons, values, unavailable)
        return values["throttle_reasons"] if ok else None

    def _read_gpm(self, values: dict, unavailable: dict) -> None:
        fields = tuple(f for _, f, _ in GPM_METRICS)
        if not self._gpm_samples:
            for f in fields:
                if f.startswith("pcie_"):
                    continue  # the legacy counters fill these
                values[f] = None
                unavailable[f] = self._gpm_reason or "GPM unavailable"
            return
        n = self.nvml
        cur = self._gpm_samples[1] if self._gpm_prev is self._gpm_samples[0] else self._gpm_samples[0]
        try:
            n.nvmlGpmSampleGet(self.handle, cur)
        except Exception as exc:
            self._gpm_prev = None  # the next read starts a new pair
            for f in fields:
                values[f] = None
                unavailable[f] = f"nvmlGpmSampleGet: {_text(exc)}"
            return
        prev, self._gpm_prev = self._gpm_prev, cur
        if prev is None:
            for f in fields:
                values[f] = None
                unavailable[f] = "GPM needs two samples: the first was taken now"
            return
        try:
            mg = n.c_nvmlGpmMetricsGet_t()
            mg.version = n.NVML_GPM_METRICS_GET_VERSION
            mg.numMetrics = len(self._gpm_ids)
            mg.sample1, mg.sample2 = prev, cur  # older first: the metric is sample2 - sample1 over its time
            for i, (mid, _, _) in enumerate(self._gpm_ids):
                mg.metrics[i].metricId = mid
            n.nvmlGpmMetricsGet(mg)
        except Exception as exc:
            for f in fields:
                values[f] = None
                unavailable[f] = f"nvmlGpmMetricsGet: {_text(exc)}"
            return
        ok = getattr(n, "NVML_SUCCESS", 0)
        for i, (mid, field, scale) in enumerate(self._gpm_ids):
            m = mg.metrics[i]
            if m.nvmlReturn == ok:
                values[field] = float(m.value) * scale
            else:
                values[field] = None
                unavailable[field] = f"GPM metric {mid}: NVML error {int(m.nvmlReturn)}"

    def _read_xid(self, values: dict, unavailable: dict) -> None:
        if self._events is None:
            for f in ("xid_errors_total", "last_xid"):
                values[f] = None
                unavailable[f] = self._xid_reason or "Xid events unavailable"
            return
        n = self.nvml
        wait = getattr(n, "nvmlEventSetWait_v2", None) or n.nvmlEventSetWait
        xid_type = getattr(n, "nvmlEventTypeXidCriticalError", 0x8)
        timeout = getattr(n, "NVML_ERROR_TIMEOUT", 10)
        now = self.clock()
        for _ in range(XID_POLL_MAX):
            try:
                data = wait(self._events, 0)
            except Exception as exc:
                if getattr(exc, "value", None) != timeout:  # a timeout is "no event waiting"
                    # the count stays (a true lower bound); the note says it may be short
                    unavailable["xid_events"] = f"nvmlEventSetWait: {_text(exc)} (xid_errors_total may be short)"
                break
            if not int(data.eventType) & xid_type:
                continue
            xid = int(data.eventData)
            self.xid_errors_total += 1
            self.last_xid = xid
            if xid in FATAL_XIDS:
                self._fatal_xids[xid] = FATAL_XIDS[xid]
            else:
                self._xid_times.append((now, xid))
        self._xid_times = [(t, x) for t, x in self._xid_times if now - t <= XID_DEGRADED_S]
        values["xid_errors_total"] = self.xid_errors_total
        values["last_xid"] = self.last_xid  # None = no Xid seen since start (a value, not a gap)

    def _read_slow(self) -> dict:
        """Retired pages and remapped rows change rarely: every SLOW_EVERY_S."""
        now = self.clock()
        if now - self._slow_at < SLOW_EVERY_S:
            return self._slow
        self._slow_at = now
        n, h, out, gaps = self.nvml, self.handle, {}, {}
        self._group("nvmlDeviceGetRetiredPagesPendingStatus", ("pages_pending",),
                    lambda: {"pages_pending": int(n.nvmlDeviceGetRetiredPagesPendingStatus(h))
                             == getattr(n, "NVML_FEATURE_ENABLED", 1)}, out, gaps)

        def remapped():
            _corr, _unc, pending, failure = n.nvmlDeviceGetRemappedRows(h)
            return {"rows_pending": bool(pending), "rows_failed": bool(failure)}

        self._group("nvmlDeviceGetRemappedRows", ("rows_pending", "rows_failed"), remapped, out, gaps)
        self._slow = out
        return out

    def _read_health(self, values: dict, unavailable: dict, throttled: list[str] | None) -> None:
        slow = self._read_slow()
        failed, degraded = [], []
        if self._lost:
            failed.append(self._lost)
        for xid, what in sorted(self._fatal_xids.items()):
            failed.append(f"Xid {xid} ({what})")
        if slow.get("rows_failed"):
            failed.append("row remapping failed: the GPU needs service")
        if slow.get("pages_pending"):
            degraded.append("retired pages pending (a GPU reset retires them)")
        if slow.get("rows_pending"):
            degraded.append("remapped rows pending (a GPU reset applies them)")
        protective = {name for _, name, bad in THROTTLE_REASONS if bad}
        slowed = [r for r in (throttled or []) if r in protective]
        if slowed:
            degraded.append("clocks slowed: " + ", ".join(slowed))
        if self._xid_times:
            recent = sorted({x for _, x in self._xid_times})
            degraded.append(f"Xid {', '.join(map(str, recent))} in the last {XID_DEGRADED_S / 60:.0f} min")
        inputs = [throttled is not None, self._events is not None,
                  any(v is not None for v in slow.values())]
        if failed or degraded or any(inputs):
            values["health"] = "failed" if failed else "degraded" if degraded else "ok"
            values["health_reasons"] = failed + degraded
        else:  # nothing health depends on could be read: saying "ok" would be a guess
            values["health"] = values["health_reasons"] = None
            unavailable["health"] = unavailable["health_reasons"] = \
                "no health input readable (clock event reasons, Xid events, retired pages, remapped rows)"

    # ---- static facts and teardown ----------------------------------------------------------------
    def info(self) -> dict:
        n, h = self.nvml, self.handle
        out: dict = {"nvml_handle_by": self.how, "gpm": self._gpm_reason or "supported",
                     "xid_events": self._xid_reason or "registered"}
        for key, fn in (("name", lambda: n.nvmlDeviceGetName(h)), ("uuid", lambda: n.nvmlDeviceGetUUID(h)),
                        ("driver_version", n.nvmlSystemGetDriverVersion),
                        ("cuda_driver_version", lambda: "{}.{}".format(*divmod(
                            int(n.nvmlSystemGetCudaDriverVersion()) // 10, 100))),
                        ("compute_capability", lambda: "{}.{}".format(*n.nvmlDeviceGetCudaComputeCapability(h)))):
            try:
                v = fn()
                out[key] = v.decode() if isinstance(v, bytes) else v
            except Exception as exc:
                out[key] = None
                out.setdefault("unavailable", {})[key] = _text(exc)
        return out

    def close(self) -> None:
        n = self.nvml
        for s in self._gpm_samples:
            try:
                n.nvmlGpmSampleFree(s)
            except Exception:
                pass
        self._gpm_samples = []
        self._free_events()
        try:
            n.nvmlShutdown()
        except Exception:
            pass

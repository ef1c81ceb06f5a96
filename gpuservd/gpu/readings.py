"""Device and host readings, once a second, for status, /metrics, the console and the hint rules.

    reader = DeviceReader("cuda:0")   # or "cpu"
    reading = reader.read()           # a JSON-ready dict; never raises
    reader.close()

A reading has every key of DEVICE_FIELDS and HOST_FIELDS. A field that could
not be read is None, never 0, and `unavailable[field]` says why: on a CPU
device every device field is None with "no CUDA device"; without the
nvidia-ml-py package "nvidia-ml-py not installed"; when NVML cannot start
"NVML init failed: ...". `source` lists where the values came from: "nvml"
(the device), "nvml-gpm" (Hopper+ performance counters), "psutil" (the host).

Device fields (NVML):
  sm_util_pct          share of time a kernel ran (nvidia-smi's GPU-Util; not the share of SMs busy)
  mem_util_pct         share of time device memory was read or written (nvidia-smi's Memory-Util)
  mem_used_bytes, mem_total_bytes
  pcie_tx_bytes_per_s, pcie_rx_bytes_per_s   GPM counters on Hopper+, else nvmlDeviceGetPcieThroughput
  temperature_c, power_w, sm_clock_mhz, mem_clock_mhz
  sm_active_pct        GPM: share of SMs busy (the one to read for "SMs idle while steps are slow")
  sm_occupancy_pct     GPM: resident warps / maximum
  mem_bw_util_pct      GPM: HBM bandwidth used / peak (for bandwidth priority); None before Hopper
  tensor_active_pct    GPM: share of time tensor cores worked
  throttle_reasons     clock event reasons, e.g. ["sw_power_cap"], ["hw_thermal"]
  xid_errors_total     critical Xid events since this reader started; last_xid the latest (None: none yet)
  health               "ok" | "degraded" | "failed"; health_reasons lists why (empty when ok)
Host fields (psutil): cpu_util_pct (since the previous read), host_mem_used_bytes (total - available),
  host_mem_total_bytes, process_rss_bytes (this process).
"""

from __future__ import annotations

import threading
import time

from gpuservd.gpu.nvml import NvmlDevice, NvmlUnavailable

DEVICE_FIELDS = ("sm_util_pct", "mem_util_pct", "mem_used_bytes", "mem_total_bytes", "pcie_tx_bytes_per_s",
                 "pcie_rx_bytes_per_s", "temperature_c", "power_w", "sm_clock_mhz", "mem_clock_mhz",
                 "sm_active_pct", "sm_occupancy_pct", "mem_bw_util_pct", "tensor_active_pct",
                 "throttle_reasons", "xid_errors_total", "last_xid", "health", "health_reasons")
HOST_FIELDS = ("cpu_util_pct", "host_mem_used_bytes", "host_mem_total_bytes", "process_rss_bytes")
NO_CUDA = "no CUDA device"


def cuda_index(device: str) -> int | None:
    """"cuda:1" -> 1, "cuda" -> 0, anything else (cpu) -> None."""
    if not device.startswith("cuda"):
        return None
    return int(device.split(":", 1)[1]) if ":" in device else 0


def cuda_identity(index: int) -> dict | str:
    """What NVML needs to find CUDA device `index` (uuid, pci_bus_id, index), or why there is none."""
    try:  # torch only when a CUDA device is asked about: `gpuserv doctor` reads this without one
        import torch
    except ImportError:
        return "torch not installed"
    try:
        if not torch.cuda.is_available():
            return NO_CUDA
        if index >= torch.cuda.device_count():
            return f"{NO_CUDA} at index {index} ({torch.cuda.device_count()} visible)"
        props = torch.cuda.get_device_properties(index)
    except Exception as exc:
        return f"{NO_CUDA} ({exc})"
    ident: dict = {"index": index, "name": props.name, "uuid": str(getattr(props, "uuid", "") or "") or None}
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        ident["pci_bus_id"] = "{:08X}:{:02X}:{:02X}.0".format(getattr(props, "pci_domain_id", 0), bus,
                                                              getattr(props, "pci_device_id", 0))
    return ident


class HostReader:
    """CPU utilisation between reads (own previous sample: psutil.cpu_percent keeps one per thread, which
    another caller in the process would disturb), host memory and this process's RSS."""

    def __init__(self):
        try:
            import psutil  # here: a missing psutil is a reading's reason, not a failed start
        except ImportError:
            self.psutil, self.reason = None, "psutil not installed"
            return
        self.psutil, self.reason = psutil, None
        self._proc = psutil.Process()
        self._prev = self._cpu_sample()

    def _cpu_sample(self) -> tuple[float, float] | None:
        """(busy, total) CPU seconds since boot; guest time is already counted inside user/nice."""
        try:
            t = self.psutil.cpu_times()
        except Exception:
            return None
        total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
        idle = t.idle + getattr(t, "iowait", 0.0)
        return total - idle, total

    def read(self, values: dict, unavailable: dict) -> None:
        if self.psutil is None:
            for f in HOST_FIELDS:
                values[f] = None
                unavailable[f] = self.reason
            return
        cur, prev = self._cpu_sample(), self._prev
        if cur and prev and cur[1] - prev[1] > 0:
            values["cpu_util_pct"] = round(min(100.0, max(0.0, 100.0 * (cur[0] - prev[0]) / (cur[1] - prev[1]))), 2)
            self._prev = cur
        else:  # no CPU time passed since the last read (two reads within a clock tick): keep the old sample
            values["cpu_util_pct"] = None
            unavailable["cpu_util_pct"] = "no CPU time elapsed since the previous read" if cur else "cpu_times failed"
        try:
            vm = self.psutil.virtual_memory()
            values["host_mem_total_bytes"] = int(vm.total)
            values["host_mem_used_bytes"] = int(vm.total - vm.available)
        except Exception as exc:
            values["host_mem_total_bytes"] = values["host_mem_used_bytes"] = None
            unavailable["host_mem_total_bytes"] = unavailable["host_mem_used_bytes"] = f"virtual_memory: {exc}"
        try:
            values["process_rss_bytes"] = int(self._proc.memory_info().rss)
        except Exception as exc:
            values["process_rss_bytes"] = None
            unavailable["process_rss_bytes"] = f"memory_info: {exc}"


class DeviceReader:
    """Readings of one device (`cpu` or `cuda:N`) and the host it sits in.

    `read()` is cheap (NVML queries of microseconds; see gpu/nvml.py for the one that is not) and never
    raises: a failure becomes a reason in `unavailable`. It is safe to call from one reader thread while
    another thread calls `info()`. `nvml` (a pynvml-shaped module) and `identity` (index -> dict | reason)
    are for tests; by default pynvml and torch are asked.
    """

    def __init__(self, device: str = "cpu", *, nvml=None, identity=None):
        self.device = device
        self._lock = threading.Lock()
        self._host = HostReader()
        self._nvml = None  # an NvmlDevice once NVML answers for this device
        self._reason: str | None = None  # why the device fields are None
        self._info: dict = {"device": device}
        index = cuda_index(device)
        if index is None:
            self._reason = NO_CUDA
            return
        ident = (identity or cuda_identity)(index)
        if isinstance(ident, str):
            self._reason = ident
            return
        self._info.update({k: v for k, v in ident.items() if k in ("name", "uuid", "pci_bus_id")})
        if nvml is None:
            try:
                import pynvml as nvml  # only with a CUDA device: torch-free commands never load NVML
            except ImportError:
                self._reason = "nvidia-ml-py not installed"
                return
        try:
            self._nvml = NvmlDevice.open(nvml, ident)
        except NvmlUnavailable as exc:
            self._reason = str(exc)
        except Exception as exc:  # a broken binding must not stop the daemon
            self._reason = f"NVML init failed: {type(exc).__name__}: {exc}"
        if self._nvml is not None:
            self._info.update(self._nvml.info())

    @property
    def available(self) -> bool:
        """True when NVML answers for the device (its fields can be read)."""
        return self._nvml is not None

    @property
    def reason(self) -> str | None:
        """Why the device fields are None (None when NVML answers)."""
        return self._reason

    def info(self) -> dict:
        """Static facts: device, name, uuid, driver and CUDA driver versions, compute capability, whether GPM
        and Xid events work (or the reason), or `unavailable_reason`."""
        out = dict(self._info)
        if self._reason:
            out["unavailable_reason"] = self._reason
        return out

    def read(self) -> dict:
        t0 = time.perf_counter()
        values: dict = {"t": time.time(), "device": self.device}
        unavailable: dict = {}
        source: list[str] = []
        with self._lock:
            try:
                if self._nvml is not None:
                    self._nvml.read(values, unavailable)
                    source.append("nvml")
                    if self._nvml._gpm_samples:
                        source.append("nvml-gpm")
            except Exception as exc:  # a bug in our parsing: every device field becomes its reason
                for f in DEVICE_FIELDS:
                    values[f] = None
                    unavailable[f] = f"reading failed: {type(exc).__name__}: {exc}"
            for f in DEVICE_FIELDS:
                if f not in values:
                    values[f] = None
                    unavailable.setdefault(f, self._reason or "not read")
            try:
                self._host.read(values, unavailable)
                if self._host.psutil is not None:
                    source.append("psutil")
            except Exception as exc:
                for f in HOST_FIELDS:
                    values[f] = None
                    unavailable[f] = f"reading failed: {type(exc).__name__}: {exc}"
        values["source"] = source
        values["unavailable"] = unavailable
        values["read_ms"] = round(1000 * (time.perf_counter() - t0), 3)
        return values

    def close(self) -> None:
        with self._lock:
            if self._nvml is not None:
                self._nvml.close()
                self._nvml = None
                self._reason = "reader closed"


class PhaseSampler:
    """Readings taken every `interval_s` on a thread while a measurement runs (`with PhaseSampler(reader):`),
    summarized as the median of each field in `fields`. A benchmark phase then says at what clocks and
    load the device ran: a launch-bound phase can run at a fraction of the clocks a busy one gets, and its
    step times say nothing about the scheduler until that is known. Fields never read (no CUDA device,
    no NVML) come back as null with the reason, as everywhere else."""

    FIELDS = ("sm_clock_mhz", "sm_util_pct", "power_w", "mem_bw_util_pct")

    def __init__(self, reader: DeviceReader, interval_s: float = 0.5, fields: tuple[str, ...] = FIELDS):
        self.reader, self.interval_s, self.fields = reader, interval_s, fields
        self._samples: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> PhaseSampler:
        """Begin sampling (what `with` does on entry)."""
        self._samples.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="phase-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> PhaseSampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self) -> None:
        while True:
            self._samples.append(self.reader.read())
            if self._stop.wait(self.interval_s):
                return

    def summary(self) -> dict:
        """{field: median or None}, `samples`, and `unavailable` {field: reason} for the fields never read."""
        out: dict = {"samples": len(self._samples)}
        unavailable: dict = {}
        for f in self.fields:
            values = sorted(s[f] for s in self._samples if s.get(f) is not None)
            out[f] = values[len(values) // 2] if values else None
            if not values:
                reasons = [s["unavailable"].get(f) for s in self._samples if s["unavailable"].get(f)]
                unavailable[f] = reasons[-1] if reasons else "no sample"
        if unavailable:
            out["unavailable"] = unavailable
        return out

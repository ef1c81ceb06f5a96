"""Hardware profiles: what the SM partition planner and the memory quotas plan against.

A profile is a YAML file in profiles/hardware/ (also looked up under
$GPUSERV_PROFILES/hardware and /etc/gpuserv/profiles/hardware, which win):

    name: a100
    description: NVIDIA A100 80GB SXM4
    num_sms: 108
    compute_capability: "8.0"
    memory: 80GB             # the datasheet figure, read as decimal GB (see below)
    mem_bw_gb_s: 2039        # HBM/GDDR bandwidth, GB/s (10^9 bytes per second)
    match: [a100]            # tokens of a device name (torch / NVML) that pick this profile
    exclude: [40gb, pcie]    # tokens that rule it out (another SKU of the same chip)

Memory in the profiles is the datasheet capacity read as decimal GB, so a plan
against a profile is slightly conservative (an "80 GB" A100 really holds 80 GiB);
the daemon plans against the device's own reading (`hardware_from_device`), which
is exact. No torch here: `gpuserv plan` must answer at once.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuservd.config import parse_bytes, read_yaml_file
from gpuservd.errors import UserError

SOURCE_PROFILES = Path(__file__).resolve().parent.parent.parent / "profiles" / "hardware"
_KEYS = {"name", "description", "num_sms", "compute_capability", "memory", "mem_bw_gb_s", "tpc_sms", "match",
         "exclude"}


@dataclass(frozen=True)
class SmGranularity:
    """How finely a device's SMs can be split into green-context partitions."""

    min_sms: int  # the smallest partition
    align_sms: int  # every partition is a multiple of this


def granularity(compute_capability: tuple[int, int], tpc_sms: int = 2) -> SmGranularity:
    """Minimum partition and alignment for cuDevSmResourceSplitByCount, by compute capability.

    CUDA driver API 12.4, Green Contexts: "On Compute Architecture 6.X: The minimum count is 1 SM.
    7.X: The minimum count is 2 SMs and must be a multiple of 2. 8.X: The minimum count is 4 SMs and
    must be a multiple of 2. 9.0+: The minimum count is 8 SMs and must be a multiple of 8."
    (docs.nvidia.com/cuda/archive/12.4.0/cuda-driver-api/group__CUDA__GREEN__CONTEXTS.html; the 13.x
    pages give the same alignment, sm.smCoscheduledAlignment: 2 on 7.x/8.x, 8 on 9.0+.) We allocate
    whole TPCs (2 SMs), so 6.x gets 2 as well.
    """
    major = compute_capability[0]
    if major >= 9:
        return SmGranularity(min_sms=8, align_sms=8)
    if major == 8:
        return SmGranularity(min_sms=max(4, tpc_sms), align_sms=tpc_sms)
    return SmGranularity(min_sms=tpc_sms, align_sms=tpc_sms)


@dataclass(frozen=True)
class Hardware:
    """One device as the planner sees it."""

    name: str  # profile name (a100) or a slug of the device's name
    num_sms: int
    compute_capability: tuple[int, int]
    memory_bytes: int
    mem_bw_bytes_per_s: float | None = None  # None = unknown (a device that matches no profile)
    tpc_sms: int = 2  # SMs per TPC, the allocation unit
    description: str = ""
    match: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    source: str = "profile"  # profile | device | device+profile
    notes: tuple[str, ...] = field(default=())  # what was assumed (e.g. an unreported compute capability)

    @property
    def granularity(self) -> SmGranularity:
        return granularity(self.compute_capability, self.tpc_sms)

    @property
    def cc(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"

    def to_dict(self) -> dict:
        g = self.granularity
        return {"name": self.name, "description": self.description, "num_sms": self.num_sms,
                "compute_capability": self.cc, "memory_bytes": self.memory_bytes,
                "mem_bw_bytes_per_s": self.mem_bw_bytes_per_s, "tpc_sms": self.tpc_sms,
                "min_partition_sms": g.min_sms, "alignment_sms": g.align_sms, "source": self.source}


def parse_cc(value, where: str) -> tuple[int, int]:
    """"8.0", 8.9, [9, 0] or (9, 0) -> (major, minor)."""
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        m = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(value))
        if m:
            return int(m.group(1)), int(m.group(2))
    raise UserError(f"{where}: compute_capability must look like \"8.0\" or [8, 0], got {value!r}")


def hardware_dirs(profiles_dir: Path | str | None = None) -> list[Path]:
    """Where profiles are looked up, first match wins: <profiles_dir>/hardware (the daemon's
    server.profiles_dir), $GPUSERV_PROFILES/hardware, /etc/gpuserv/profiles/hardware, the source tree's."""
    dirs = [Path(profiles_dir).expanduser() / "hardware"] if profiles_dir else []
    if os.environ.get("GPUSERV_PROFILES"):
        dirs.append(Path(os.environ["GPUSERV_PROFILES"]).expanduser() / "hardware")
    dirs += [Path("/etc/gpuserv/profiles/hardware"), SOURCE_PROFILES]
    return [d for d in dirs if d.is_dir()]


def _profile_paths(profiles_dir=None) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in hardware_dirs(profiles_dir):
        for p in sorted(d.glob("*.yaml")):
            found.setdefault(p.stem, p)
    return found


def list_hardware(profiles_dir=None) -> list[str]:
    """Names of the known profiles, sorted."""
    return sorted(_profile_paths(profiles_dir))


def hardware_from_dict(data, where: str) -> Hardware:
    """Build a Hardware from a profile mapping; unknown keys and bad values are UserErrors."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: a hardware profile must be a mapping "
                        "(name, num_sms, compute_capability, memory, ...)")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_KEYS))}")
    missing = [k for k in ("name", "num_sms", "compute_capability", "memory") if k not in data]
    if missing:
        raise UserError(f"{where}: missing {', '.join(missing)}")
    num_sms = data["num_sms"]
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        raise UserError(f"{where}: num_sms must be a positive integer, got {num_sms!r}")
    tpc = data.get("tpc_sms", 2)
    if isinstance(tpc, bool) or not isinstance(tpc, int) or tpc < 1:
        raise UserError(f"{where}: tpc_sms must be a positive integer, got {tpc!r}")
    bw = data.get("mem_bw_gb_s")
    if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float)) or bw <= 0):
        raise UserError(f"{where}: mem_bw_gb_s must be a positive number (GB/s), got {bw!r}")
    tokens = {}
    for key in ("match", "exclude"):
        value = data.get(key) or []
        if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
            raise UserError(f"{where}: {key} must be a list of name tokens like [a100], got {value!r}")
        tokens[key] = tuple(t.lower() for t in value)
    return Hardware(
        name=str(data["name"]), num_sms=num_sms, compute_capability=parse_cc(data["compute_capability"], where),
        memory_bytes=parse_bytes(data["memory"], f"{where}: memory"),
        mem_bw_bytes_per_s=float(bw) * 1e9 if bw is not None else None, tpc_sms=tpc,
        description=str(data.get("description") or ""), match=tokens["match"], exclude=tokens["exclude"])


def load_hardware(name: str, profiles_dir=None) -> Hardware:
    """A profile by name (profiles/hardware/<name>.yaml); an unknown name lists the known ones."""
    paths = _profile_paths(profiles_dir)
    key = str(name).strip().lower()
    if key not in paths:
        known = ", ".join(sorted(paths)) or "none (profiles/hardware/ is missing)"
        raise UserError(f"unknown hardware {name!r}; known profiles: {known}")
    hw = hardware_from_dict(read_yaml_file(paths[key]), str(paths[key]))
    if hw.name != key:
        raise UserError(f"{paths[key]}: name {hw.name!r} differs from the file name {key!r}")
    return hw


def _tokens(device_name: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", device_name.lower()))


def match_profile(device_name: str, profiles_dir=None) -> Hardware | None:
    """The profile whose match tokens all occur in the device's name and none of whose exclude tokens
    do; the most specific (most tokens) wins. "NVIDIA A100-SXM4-40GB" -> a100-40gb, "NVIDIA A10G" -> none."""
    words = _tokens(device_name)
    best, best_len = None, 0
    for name in list_hardware(profiles_dir):
        try:
            hw = load_hardware(name, profiles_dir)
        except UserError:
            continue  # a broken profile must not stop the daemon from planning with the device's numbers
        if hw.match and all(t in words for t in hw.match) and not any(t in words for t in hw.exclude):
            if len(hw.match) > best_len:
                best, best_len = hw, len(hw.match)
    return best


def _slug(text: str) -> str:
    words = re.findall(r"[a-z0-9]+", text.lower())
    words = [w for w in words if w not in ("nvidia", "tesla", "geforce")]
    return "-".join(words) or "gpu"


def hardware_from_device(info: dict, profiles_dir=None) -> Hardware | None:
    """The daemon's device dict -> Hardware, or None on a CPU (no SMs to partition) or an absent GPU.

    info: {"backend": "cuda", "name", "num_sms", "memory_bytes", "compute_capability"?: [8, 0] | "8.0"}.
    The device's own SM count, memory and compute capability win over a matching profile's (a MIG slice
    or a cut-down SKU reports fewer SMs); the profile adds what the device does not report (bandwidth).
    Without a reported compute capability and no matching profile, the strictest rules (9.0+: 8-SM
    partitions) are assumed and said in `notes`.
    """
    if not info or info.get("backend") != "cuda" or info.get("available") is False:
        return None
    name = str(info.get("name") or "")
    num_sms = info.get("num_sms")
    memory = info.get("memory_bytes")
    if not isinstance(num_sms, int) or num_sms < 1 or not isinstance(memory, int):
        raise UserError(f"device {name!r} reports no SM count or memory size ({info!r}); name a hardware profile")
    cc_value = info.get("compute_capability")
    cc = parse_cc(cc_value, f"device {name!r}") if cc_value is not None else None
    profile = match_profile(name, profiles_dir)
    notes = []
    if profile is not None:
        if profile.num_sms != num_sms:
            notes.append(f"the device reports {num_sms} SMs, the {profile.name} profile {profile.num_sms}; "
                         "planning with the device's")
        return replace(profile, num_sms=num_sms, memory_bytes=memory,
                       compute_capability=cc or profile.compute_capability,
                       description=name or profile.description, source="device+profile", notes=tuple(notes))
    if cc is None:
        cc = (9, 0)
        notes.append("the device reports no compute capability; assuming the strictest partition rules (9.0+)")
    return Hardware(name=_slug(name), num_sms=num_sms, compute_capability=cc, memory_bytes=memory,
                    description=name, source="device", notes=tuple(notes))

"""The `sharing:` section: how models that live on one device share it: SM partitions,
time slices, memory quotas and bandwidth priority.

    sharing:
      enabled: true              # the arbiter; false = naive co-location (every model steps when it likes)
      backend: auto              # auto | green_context | mps | none  (SM partition enforcement)
      hardware: auto             # auto (the device's own numbers) | a profile in profiles/hardware/
      quantum_ms: 20             # time slice among models sharing an SM group, 10-50
      headroom: 0.2              # memory quota = (weights + peak KV + activations + overhead) x 1.2
      bandwidth_priority: true   # throttle best-effort models while a latency-critical one is slow
      throttle: {increase: 0.05, decrease: 0.5, min_duty: 0.05, interval_ms: 200, mem_bw_threshold_pct: 90}
      models:
        chat:       {share: 0.4, class: latency_critical, step_target_ms: 50}
        classifier: {share: 0.35, class: best_effort, group: batch}

A model not listed gets an equal part of the share the listed ones leave and the
class best_effort. Models naming the same `group` share one SM partition and
take turns in time slices; without a partition backend (a CPU, or CUDA with
neither green contexts nor MPS) nothing keeps partitions apart, so every model
is in one group: the whole device, time-sliced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuservd.config import _fill, parse_bytes
from gpuservd.errors import Choice, UserError
from gpuservd.gpu.backends import Backend


class SharingClass(Choice, setting="sharing.models.<name>.class"):
    LATENCY_CRITICAL = "latency_critical"
    BEST_EFFORT = "best_effort"


@dataclass
class ModelSharing:
    """One model's part of the device."""

    share: float = 0.0  # fraction of the device's compute (SMs); 0 = an equal part of what is left
    sharing_class: SharingClass = SharingClass.BEST_EFFORT  # YAML key: class
    group: str = ""  # models naming the same group share one SM partition ("" = a partition of its own)
    step_target_ms: float = 0.0  # latency_critical: bandwidth priority acts when its steps pass this
    # (0 = 1.5x its own median step time while it ran alone, learned by the arbiter)
    weights_bytes: int | None = None  # memory quota terms; None = the model's weights in the compute dtype
    kv_peak_bytes: int | None = None  # None = what the loaded engine has (its KV pool)
    activation_bytes: int | None = None  # None = an estimate from the model's shape and token budget
    overhead_bytes: int | None = None  # None = the backend's fixed cost (CUDA context ~ 500 MiB; CPU 0)
    memory_quota_bytes: int | None = None  # a fixed quota instead of the computed one


@dataclass
class ThrottleConfig:
    """Additive increase, multiplicative decrease of best-effort models' duty cycle
    (bandwidth priority: HBM bandwidth is shared even between SM partitions)."""

    increase: float = 0.05  # duty cycle gained per calm interval
    decrease: float = 0.5  # duty cycle multiplied by this when a latency-critical model is slow
    min_duty: float = 0.05  # never throttled below this share of the time
    interval_ms: float = 200.0  # how often the controller looks
    mem_bw_threshold_pct: float = 90.0  # device memory-bandwidth use (NVML GPM, Hopper+) above this is pressure too


@dataclass
class SharingConfig:
    enabled: bool = True
    backend: Backend = Backend.AUTO
    hardware: str = "auto"
    quantum_ms: float = 20.0
    headroom: float = 0.2
    bandwidth_priority: bool = True
    throttle: ThrottleConfig = field(default_factory=ThrottleConfig)
    models: dict[str, ModelSharing] = field(default_factory=dict)

    def validate(self) -> None:
        if not 10 <= self.quantum_ms <= 50:
            raise UserError(f"sharing.quantum_ms must be in [10, 50] ms (the seed's range), got {self.quantum_ms}")
        if not 0 <= self.headroom < 1:
            raise UserError(f"sharing.headroom must be in [0, 1), got {self.headroom}")
        t = self.throttle
        if not 0 < t.decrease < 1 or not 0 < t.increase <= 1 or not 0 < t.min_duty <= 1 or t.interval_ms <= 0 \
                or not 0 < t.mem_bw_threshold_pct <= 100:
            raise UserError("sharing.throttle: decrease must be in (0, 1), increase and min_duty in (0, 1], "
                            "interval_ms > 0, mem_bw_threshold_pct in (0, 100]")
        total = sum(m.share for m in self.models.values())
        if total > 1.0 + 1e-9:
            raise UserError(f"sharing.models: the shares add up to {total:.2f}; they must add up to at most 1.0")
        for name, m in self.models.items():
            if not 0 <= m.share <= 1:
                raise UserError(f"sharing.models.{name}.share must be in [0, 1], got {m.share}")
            if m.step_target_ms < 0:
                raise UserError(f"sharing.models.{name}.step_target_ms must be >= 0, got {m.step_target_ms}")

    def model(self, name: str) -> ModelSharing:
        """A model's settings; an unlisted model is best effort with an equal part of the rest."""
        return self.models.get(name) or ModelSharing()

    def shares(self, names: list[str]) -> dict[str, float]:
        """Each model's compute share: listed shares as given, the rest split evenly among the unlisted
        (and zero-share) models. Shares of models that are not loaded are not handed to others."""
        fixed = {n: self.models[n].share for n in names if n in self.models and self.models[n].share > 0}
        rest = [n for n in names if n not in fixed]
        left = max(0.0, 1.0 - sum(m.share for m in self.models.values()))
        out = dict(fixed)
        for n in rest:
            out[n] = left / len(rest) if rest else 0.0
        return out

    def group_of(self, name: str) -> str:
        return self.model(name).group or name


_MODEL_KEYS = {"share", "class", "group", "step_target_ms", "weights_bytes", "kv_peak_bytes", "activation_bytes",
               "overhead_bytes", "memory_quota_bytes"}


def sharing_from_dict(data: dict | None, where: str) -> SharingConfig:
    """Parse a `sharing:` mapping (unknown keys are errors, like every other section)."""
    cfg = SharingConfig()
    raw = dict(data or {})
    if not isinstance(data or {}, dict):
        raise UserError(f"{where}: sharing: must be a mapping")
    models = raw.pop("models", None) or {}
    backend = raw.pop("backend", None)
    _fill(cfg, raw, where, "sharing.")
    if backend is not None:
        try:
            cfg.backend = Backend.parse(str(backend))
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None
    if not isinstance(models, dict):
        raise UserError(f"{where}: sharing.models must map model names to {{share, class, ...}}")
    for name, spec in models.items():
        spec = spec or {}
        if not isinstance(spec, dict):
            raise UserError(f"{where}: sharing.models.{name} must be a mapping like {{share: 0.4, class: best_effort}}")
        unknown = sorted(set(spec) - _MODEL_KEYS)
        if unknown:
            raise UserError(f"{where}: unknown key sharing.models.{name}.{unknown[0]}; known: {', '.join(sorted(_MODEL_KEYS))}")
        m = ModelSharing()
        for key, value in spec.items():
            at = f"{where}: sharing.models.{name}.{key}"
            if key == "class":
                try:
                    m.sharing_class = SharingClass(str(value))
                except ValueError:
                    raise UserError(f"{at} {value!r} is unknown; choose one of: "
                                    f"{', '.join(c.value for c in SharingClass)}") from None
            elif key == "group":
                if not isinstance(value, str):
                    raise UserError(f"{at} must be a string, got {value!r}")
                m.group = value
            elif key.endswith("_bytes"):
                setattr(m, key, None if value is None else parse_bytes(value, at))
            else:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise UserError(f"{at} must be a number, got {value!r}")
                setattr(m, key, float(value))
        cfg.models[str(name)] = m
    try:
        cfg.validate()
    except UserError as exc:
        raise UserError(f"{where}: {exc}") from None
    return cfg

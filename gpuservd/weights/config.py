"""The weight cache's settings: the `cache:` section, and the seed's `model:` profile section."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuservd.errors import UserError


@dataclass
class CacheConfig:
    """Tiers, loading and eviction for every model the daemon serves."""

    device_bytes: int | None = None  # device tier budget for weights; None = engine.device_memory_bytes
    host_bytes: int = 2 * 1024**3  # host tier budget (RAM; pinned on CUDA)
    cache_size: int = 3  # models resident on the device at most
    cache_policy: str = "lru"  # lru (the only one; pinned models are never evicted)
    keep_alive_s: float = -1.0  # Ollama's keep_alive: an idle model leaves the device (down a tier) after this
    # long by itself, and is not evicted before; negative = never by itself, 0 = right after its last request.
    # A request's `keep_alive` overrides it for its model.
    load_strategy: str = "full"  # full | layered
    initial_layers: int = 8  # layered: serve once these many layers are in
    compression: str = "none"  # none | int8: what the host and disk tiers hold
    compression_models: dict = field(default_factory=dict)  # per model: {name: none | int8}, over `compression`
    int8_min_agreement: float = 0.99  # int8 is refused for a model whose INT8 weights' teacher-forced top-1
    # agreement with full precision is under this (measured once, stored beside the INT8 file); 0 = no check
    load_on_demand: bool = True  # a request for a store model that is not loaded loads it
    load_timeout_s: float = 300.0  # a request waits this long for its model's load
    hit_rate_alert: float = 0.9  # below this device-tier hit rate an event suggests a bigger cache
    hit_rate_window: int = 50  # model lookups (requests) the hit rate is taken over
    prefetch: bool = False  # warm the device tier ahead of demand from learned model-to-model transitions
    prefetch_min_prob: float = 0.2  # prefetch a model only when it follows the current one this often

    def validate(self) -> None:
        if self.cache_policy != "lru":
            raise UserError(f"cache.cache_policy must be lru, got {self.cache_policy!r}")
        if self.load_strategy not in ("full", "layered"):
            raise UserError(f"cache.load_strategy must be full or layered, got {self.load_strategy!r}")
        if self.compression not in ("none", "int8"):
            raise UserError(f"cache.compression must be none or int8, got {self.compression!r}")
        if not isinstance(self.compression_models, dict):
            raise UserError(f"cache.compression_models must be a mapping {{model: none | int8}}, "
                            f"got {self.compression_models!r}")
        for name, value in self.compression_models.items():
            if value not in ("none", "int8"):
                raise UserError(f"cache.compression_models.{name} must be none or int8, got {value!r}")
        if not 0.0 <= self.int8_min_agreement <= 1.0:
            raise UserError(f"cache.int8_min_agreement must be in [0, 1], got {self.int8_min_agreement}")
        if self.cache_size < 1 or self.initial_layers < 1:
            raise UserError("cache.cache_size and cache.initial_layers must be >= 1")
        if self.host_bytes < 0 or (self.device_bytes is not None and self.device_bytes < 1):
            raise UserError("cache.host_bytes must be >= 0 and cache.device_bytes >= 1")
        if not 0.0 <= self.hit_rate_alert <= 1.0:
            raise UserError(f"cache.hit_rate_alert must be in [0, 1], got {self.hit_rate_alert}")
        if self.hit_rate_window < 2:
            raise UserError(f"cache.hit_rate_window must be >= 2, got {self.hit_rate_window}")
        if self.load_timeout_s <= 0:
            raise UserError("cache.load_timeout_s must be > 0")


# The seed's model profile, `model: {name, num_layers, load_strategy, initial_layers, prefetch,
# compression, cache_policy, cache_size}`: everything but name and num_layers is a cache setting.
MODEL_PROFILE_KEYS = ("name", "num_layers", "load_strategy", "initial_layers", "prefetch", "compression",
                      "cache_policy", "cache_size")


def apply_model_profile(profile: dict, cache: dict, where: str) -> tuple[str, int | None]:
    """Fold a `model:` section into the `cache:` dict; returns (model name, declared num_layers)."""
    if not isinstance(profile, dict) or "name" not in profile:
        raise UserError(f"{where}: model: must be a mapping with at least a name")
    unknown = sorted(set(profile) - set(MODEL_PROFILE_KEYS))
    if unknown:
        raise UserError(f"{where}: unknown key model.{unknown[0]}; known: {', '.join(MODEL_PROFILE_KEYS)}")
    for k, v in profile.items():
        if k not in ("name", "num_layers"):
            cache.setdefault(k, v)
    return str(profile["name"]), profile.get("num_layers")

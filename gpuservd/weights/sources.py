"""Where a model's weights come from for a load: the tier choice and the base/variant lookup.

A full model's weights come from the fastest tier that has them: already on the
device (held for its variants), the host copy, else the store (its INT8 file
under `cache.compression: int8`, written on first use). A variant (a delta over
a base model) runs on its base's weights in memory plus its own delta; the
base is loaded first, without an engine of its own, when it is not there.
Everything built is registered with the weight cache, which shares it with the
variants that come later. An engine worker process, which cannot see the
daemon's memory, reads the store alone (`store_source`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from gpuservd.config import EngineConfig
from gpuservd.errors import ModelNotFound
from gpuservd.runner.model_runner import DTYPES
from gpuservd.runner.load import SafetensorsReader, expected_bytes, load_weights
from gpuservd.store.layout import read_config
from gpuservd.store.store import ModelStore
from gpuservd.store.variant import validate_delta
from gpuservd.weights.cache import WeightCache
from gpuservd.weights.delta import SharedSource, VariantSource
from gpuservd.weights.int8_file import Int8Reader, ensure_int8

log = logging.getLogger("gpuservd.weights")


def store_source(model_dir: Path, compression: str) -> tuple[Any, str, int]:
    """(tensor source, tier name, bytes it reads) from the store: the INT8 file under compression int8
    (written on first use), else the safetensors files."""
    model_dir = Path(model_dir)
    reader = SafetensorsReader(model_dir)
    if compression == "int8":
        path = ensure_int8(reader, model_dir)  # written on first use; another format is made again, never read
        return Int8Reader(path), "disk-int8", path.stat().st_size
    return reader, "disk", sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


class WeightSources:
    """Chooses the tensor source (and names its tier) for each load, over one weight cache."""

    def __init__(self, cache: WeightCache, engine: Callable[[], EngineConfig], compression: str):
        self.cache = cache
        self.engine = engine  # the daemon's engine settings now (a reload replaces them): dtype sizes the weights
        self.compression = compression  # cache.compression: "int8" reads the store's INT8 file
        self.refused: dict[str, str] = {}  # model -> why int8 was refused for it (its agreement numbers)

    def wants_int8(self, name: str) -> bool:
        """int8 asked for this model (cache.compression_models, else cache.compression)."""
        return self.cache.config.compression_models.get(name, self.compression) == "int8"

    def compression_for(self, name: str) -> str:
        """What this model's disk and host tiers hold: int8 when asked and not refused, else none."""
        return "int8" if self.wants_int8(name) and name not in self.refused else "none"

    def refuse_int8(self, name: str, why: str | None) -> None:
        """Record (or, with None, clear) a refusal of int8 for this model."""
        if why is None:
            self.refused.pop(name, None)
        else:
            self.refused[name] = why

    def base_of(self, name: str) -> str | None:
        """A variant's base model; None for a full model."""
        meta = ModelStore().variant_meta(name)
        return str(meta["base"]) if meta else None

    def base_set(self, name: str) -> set[str]:
        """{its base} for a variant, else empty: the models a load must not evict."""
        base = self.base_of(name)
        return {base} if base is not None else set()

    def variant_dirs(self, name: str, model_dir: Path) -> tuple[str | None, Path]:
        """(base or None, the directory with the config and tokenizer the model runs with)."""
        base = self.base_of(name)
        if base is None:
            return None, model_dir
        try:
            return base, ModelStore().path(base)
        except ModelNotFound:
            raise ModelNotFound(f"model {name} is a variant of {base!r}, which is not in the store; "
                                f"pull or import {base} (or remove {name})") from None

    def weight_bytes(self, name: str) -> int:
        """Weight bytes a model will add to the device (from its files' headers; nothing is read):
        a variant's delta, plus its base's weights when they are not there yet."""
        store, dtype = ModelStore(), DTYPES[self.engine().dtype]
        base = self.base_of(name)
        if base is not None:
            spec = validate_delta(store.path(name), read_config(store.path(base)), base)
            own = spec.num_parameters * dtype.itemsize
            return own + (0 if self.cache.has_weights(base) else self.weight_bytes(base))
        return expected_bytes(SafetensorsReader(store.path(name)), dtype)

    def weight_source(self, name: str, model_dir: Path):
        """(weight source, tier name) for a load. A variant: its delta over the base's weights
        in memory ("delta"), the base loaded first when absent ("delta+<base's tier>"). A full model:
        its weights held for its variants ("device"), else the host copy, else the store (its INT8
        file under compression: int8, written on first use); built weights are registered with the
        cache, which shares them with the variants that come later."""
        base = self.base_of(name)
        if base is not None:
            return self.variant_source(name, base, model_dir)

        def share(build):
            return self.cache.shared_weights(name, build)

        if self.cache.has_weights(name):
            return SharedSource(model_dir, share), "device"
        source, tier = self.tier_source(name, model_dir)
        return SharedSource(source, share), tier

    def variant_source(self, name: str, base: str, model_dir: Path):
        """(VariantSource, tier name): the variant's delta over its base's shared weights."""
        base_dir = ModelStore().path(base)
        tier = "delta"
        if not self.cache.has_weights(base):
            tier = "delta+" + ("host" if self.cache.residency(base)["host"] else "disk")

        def base_weights(arch, dtype, device):
            def build():  # the base as a hidden dependency: its weights, without an engine of its own
                source, base_tier = self.tier_source(base, base_dir)
                log.info("model %s: loading its base %s from the %s tier", name, base, base_tier)
                return load_weights(source, arch, dtype, device)

            weights = self.cache.shared_weights(base, build)
            self.cache.hold_base(base, weights.nbytes(), name)
            return weights

        return VariantSource(base_weights, model_dir, read_config(base_dir), base), tier

    def tier_source(self, name: str, model_dir: Path):
        """(tensor source, tier name): the host copy, else the store (INT8 under compression: int8)."""
        host = self.cache.host_copy(name)
        if host is not None:
            self.cache.bytes_loaded["host"] += host.nbytes
            return host, "host"
        source, tier, nbytes = store_source(model_dir, self.compression_for(name))
        self.cache.bytes_loaded["disk"] += nbytes
        return source, tier

    def keep_host_copy(self, name: str, model_dir: Path) -> None:
        """Copy a loaded model's weights into the host tier (off the event loop), so that a reload after
        an eviction reads memory, not the disk."""
        try:
            self.cache.keep_host_copy(name, SafetensorsReader(model_dir), self.compression_for(name))
        except Exception as exc:  # the host tier is an optimisation: the disk still serves
            log.warning("model %s: no host copy kept (%s)", name, exc)

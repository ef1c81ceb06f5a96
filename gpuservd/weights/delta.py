"""Loading a variant over a resident base, and making test adapters.

A fine-tuned variant loads only its difference from its base. A base's weights
are one `ModelWeights` object in memory, shared *by reference* between the
base's engine and the engines of its variants; the device tier counts its bytes
once (under the base's name), and each variant's entry counts only its delta. A
variant's delta is applied at run time, unmerged (runner/variant_weights.py),
because merging would need a private copy of every targeted base matrix (the
shared one must not change: other models read it). So loading a variant whose
base is resident reads only the adapter file: `VariantSource` never opens the
base's safetensors. When only the variant is asked for, the daemon loads the
base's weights first as a hidden dependency (device entry without an engine of
its own), see weights/sources.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gpuservd.errors import StoreCorrupt, UserError
from gpuservd.runner.load import load_weights
from gpuservd.runner.variant_weights import DeltaTerm, FullPart, LoraPart, VariantWeights
from gpuservd.runner.linear import onednn_available
from gpuservd.runner.model_config import ModelArch
from gpuservd.store import variant as vspec

# projection -> (LayerWeights field, which slice of the fused output: index among the fused parts)
_FUSED = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o_proj", 0),
          "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}


def output_slice(arch: ModelArch, proj: str) -> tuple[str, int, int]:
    """(LayerWeights field, start, end) of a projection's rows in the runner's fused layout."""
    q, kv, i = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, arch.intermediate_size
    field_, k = _FUSED[proj]
    sizes = {"qkv": (q, kv, kv), "gate_up": (i, i), "o_proj": (arch.hidden_size,), "down": (arch.hidden_size,)}[field_]
    start = sum(sizes[:k])
    return field_, start, start + sizes[k]


class CountingSource:
    """A tensor source that counts the bytes handed out (what a load really read)."""

    def __init__(self, source):
        self.source = source
        self.bytes_read = 0

    def get(self, name: str) -> torch.Tensor:
        t = self.source.get(name)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read_group(self, names, pin: bool = False) -> list:
        """The loader's reader thread reads through this (runner/pipeline.py): counted like get()."""
        parts = self.source.read_group(names, pin)
        self.bytes_read += sum(t.nbytes for t in parts)  # a tensor's or a QTensor's (int8 + scales)
        return parts

    def __getattr__(self, name):  # has, names, shape, name_to_shard: the wrapped source's
        return getattr(self.source, name)


class SharedSource:
    """A full model's weights through a registry of shared weights: `share(build)` returns the
    weights already in memory for this model, or builds them with `build()` and keeps them, so a
    base's engine and its variants' engines read one object (the weight cache's `shared_weights`)."""

    def __init__(self, source, share):
        self.source = source  # a directory or tensor source, read only when nothing is shared yet
        self.share = share

    def build_weights(self, arch, dtype, device, initial_layers=None, on_layer=None):
        return self.share(lambda: load_weights(self.source, arch, dtype, device, initial_layers=initial_layers,
                                               on_layer=on_layer))


class VariantSource:
    """Builds a variant's weights over its base's ModelWeights, reading only the delta's file.

    base: the base's ModelWeights, or base(arch, dtype, device) -> ModelWeights (the daemon's
    closure returns the resident ones, loading them first when the base is not on the device)."""

    def __init__(self, base, variant_dir: Path, base_config: dict, base_name: str):
        self.base = base
        self.variant_dir = Path(variant_dir)
        self.spec = vspec.validate_delta(self.variant_dir, base_config, base_name)
        self.bytes_read = 0  # delta bytes read from the store
        self.load_s = 0.0  # reading and preparing the delta (not the base)

    def build_weights(self, arch: ModelArch, dtype: torch.dtype, device, initial_layers=None,
                      on_layer=None) -> VariantWeights:
        device = torch.device(device)
        base = self.base(arch, dtype, device) if callable(self.base) else self.base
        t0 = time.perf_counter()
        onednn = onednn_available(device, dtype)
        spec = self.spec
        path = self.variant_dir / spec.weights_file
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise StoreCorrupt(f"{path}: unreadable safetensors file ({exc})") from None

        def get(name: str) -> torch.Tensor:
            t = handle.get_tensor(name)
            self.bytes_read += t.numel() * t.element_size()
            return t.to(device=device, dtype=dtype).contiguous()

        raw: dict[int, dict[str, DeltaTerm]] = {}
        for (layer, proj), names in sorted(spec.modules.items()):
            field_, start, end = output_slice(arch, proj)
            term = raw.setdefault(layer, {}).setdefault(field_, DeltaTerm())
            if spec.kind == "lora":
                term.lora.append(LoraPart(start, end, get(names[0]), get(names[1]), spec.scales[(layer, proj)]))
            else:
                term.full.append(FullPart(start, end, get(names[0])))
        del handle
        terms = {}
        for i in range(arch.num_layers):
            ts = time.perf_counter()
            if i in raw:
                terms[i] = {f: t.build(onednn) for f, t in raw[i].items()}
            if on_layer is not None:
                on_layer(i, time.perf_counter() - ts)
        weights = VariantWeights(base, terms)
        self.load_s = time.perf_counter() - t0
        return weights


def make_adapter(base_dir: Path, out: Path, kind: str = "lora", rank: int = 8, alpha: float = 16.0,
                 targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"), seed: int = 0,
                 std: float = 0.02, layers: list[int] | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write a random adapter for the model at base_dir into `out`: a PEFT LoRA (adapter_config.json +
    adapter_model.safetensors, PEFT's tensor names) or a full-rank delta (delta_model.safetensors).

    Unlike PEFT's initialisation (B = 0, a no-op until trained), B is random (N(0, std)) so the
    variant really differs from its base; A is PEFT's kaiming-uniform range, U(+-1/sqrt(in))."""
    if kind not in vspec.KINDS:
        raise UserError(f"--kind must be one of {', '.join(vspec.KINDS)}, got {kind!r}")
    bad = [t for t in targets if t not in vspec.PROJECTIONS]
    if bad or not targets:
        raise UserError(f"--targets: {', '.join(bad) or 'none given'}: choose from {', '.join(vspec.PROJECTIONS)}")
    if kind == "lora" and rank < 1:
        raise UserError(f"--rank must be >= 1, got {rank}")
    config = json.loads((Path(base_dir) / "config.json").read_text())
    dims = vspec.projection_dims(config)
    n = int(config["num_hidden_layers"])
    layers = list(range(n)) if layers is None else layers
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in layers:
        for proj in targets:
            fin, fout = dims[proj]
            prefix = f"model.layers.{i}.{vspec.BLOCK[proj]}.{proj}"
            if kind == "lora":
                bound = fin ** -0.5
                a = (torch.rand(rank, fin, generator=g) * 2 - 1) * bound
                tensors[f"base_model.model.{prefix}.lora_A.weight"] = a.to(dtype)
                tensors[f"base_model.model.{prefix}.lora_B.weight"] = (torch.randn(fout, rank, generator=g) * std).to(dtype)
            else:
                tensors[f"{prefix}.weight"] = (torch.randn(fout, fin, generator=g) * std).to(dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if kind == "lora":
        save_file(tensors, str(out / vspec.LORA_WEIGHTS), metadata={"format": "pt"})
        cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": Path(base_dir).name,
               "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": list(targets),
               "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
               "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "inference_mode": True}
        (out / vspec.LORA_CONFIG).write_text(json.dumps(cfg, indent=2))
    else:
        save_file(tensors, str(out / vspec.DELTA_WEIGHTS), metadata={"format": "pt"})
    return out


def merged_state_dict(base_state: dict, variant_dir: Path, base_config: dict, base_name: str = "base") -> dict:
    """The base's HF state dict with the delta merged in (W + scale * B @ A, or W + dW): what PEFT's
    merge_and_unload computes; the tests and the bench compare the unmerged runner against it."""
    spec = vspec.validate_delta(Path(variant_dir), base_config, base_name)
    merged = dict(base_state)
    with safe_open(str(Path(variant_dir) / spec.weights_file), framework="pt") as f:
        for (layer, proj), names in spec.modules.items():
            key = f"model.layers.{layer}.{vspec.BLOCK[proj]}.{proj}.weight"
            w = merged[key].float()
            if spec.kind == "lora":
                a, b = f.get_tensor(names[0]).float(), f.get_tensor(names[1]).float()
                w = w + spec.scales[(layer, proj)] * (b @ a)
            else:
                w = w + f.get_tensor(names[0]).float()
            merged[key] = w.to(base_state[key].dtype)
    return merged

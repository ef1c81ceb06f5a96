"""Variant entries: a model declared as a base plus a delta, checked without torch (a fine-tuned
variant loads only its difference from the base it shares).

A variant is a store entry whose `gpuserv.yaml` says `kind: lora` or `kind: delta`
and names its `base` (a full model in the same store). Its directory holds only
the delta:

- `kind: lora`: a PEFT adapter as `save_pretrained` writes it: `adapter_config.json`
  (`r`, `lora_alpha`, `target_modules`, ...) and `adapter_model.safetensors` with
  `base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_A.weight` [r, in]
  and `...lora_B.weight` [out, r]. At run time y = W x + scale * B (A x), with
  scale = lora_alpha / r (lora_alpha / sqrt(r) under use_rslora), per module
  overridable by rank_pattern / alpha_pattern: what PEFT computes.
- `kind: delta`: a full-rank difference: `delta_model.safetensors` with
  `model.layers.<i>.<self_attn|mlp>.<proj>.weight` holding dW [out, in]; at run
  time y = W x + dW x.

Only the seven Llama projections can be targeted (q/k/v/o, gate/up/down); the
config and the tokenizer are the base's. Shapes are checked against the base's
config.json from the safetensors header alone, so `gpuserv models derive` (and
`models ls`) stay torch-free and fast.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpuservd.errors import StoreCorrupt, UserError
from gpuservd.store import layout

LORA_CONFIG = "adapter_config.json"
LORA_WEIGHTS = "adapter_model.safetensors"
DELTA_WEIGHTS = "delta_model.safetensors"
KINDS = ("lora", "delta")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BLOCK = {p: ("mlp" if p in ("gate_proj", "up_proj", "down_proj") else "self_attn") for p in PROJECTIONS}
_LORA_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_DELTA_NAME = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.weight")
# PEFT options whose math this runner does not implement: refused rather than served wrong.
_UNSUPPORTED = {"use_dora": True, "fan_in_fan_out": True}


@dataclass
class DeltaSpec:
    """What a variant's delta holds, validated against its base."""

    kind: str  # lora | delta
    files: list[str]  # the delta's files, relative to its directory
    weights_file: str  # the safetensors file inside them
    targets: list[str]  # projections touched, e.g. ["q_proj", "v_proj"]
    layers: list[int]  # layers touched
    rank: int  # largest LoRA rank (0 for a full-rank delta)
    alpha: float  # lora_alpha (0 for a full-rank delta)
    num_parameters: int  # elements in the delta's tensors
    dtype: str  # dtype of the delta's tensors
    nbytes: int  # bytes of the delta's tensors on disk
    # (layer, projection) -> tensor names: (lora_A, lora_B) or (dW,)
    modules: dict[tuple[int, str], tuple[str, ...]] = field(default_factory=dict)
    scales: dict[tuple[int, str], float] = field(default_factory=dict)  # LoRA scale per module


def projection_dims(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a base with this config.json."""
    d = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hd = int(config.get("head_dim") or d // heads)
    inter = int(config["intermediate_size"])
    return {"q_proj": (d, heads * hd), "k_proj": (d, kv * hd), "v_proj": (d, kv * hd), "o_proj": (heads * hd, d),
            "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}


def detect_kind(adapter_dir: Path) -> str:
    if (adapter_dir / LORA_CONFIG).is_file():
        return "lora"
    if (adapter_dir / DELTA_WEIGHTS).is_file():
        return "delta"
    raise UserError(f"{adapter_dir}: neither a PEFT LoRA adapter ({LORA_CONFIG} + {LORA_WEIGHTS}) nor a "
                    f"full-rank delta ({DELTA_WEIGHTS}); `gpuserv models make-adapter` writes either")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name ending in it."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def lora_scale(cfg: dict, module: str, rank: int) -> float:
    alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, cfg.get("lora_alpha", 8)))
    return alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank


def read_lora_config(adapter_dir: Path) -> dict:
    path = adapter_dir / LORA_CONFIG
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreCorrupt(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise StoreCorrupt(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise StoreCorrupt(f"{path}: expected a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UserError(f"{path}: peft_type {cfg['peft_type']!r} is not supported (LORA only)")
    for key, bad in _UNSUPPORTED.items():
        if cfg.get(key) == bad:
            raise UserError(f"{path}: {key}: {bad} is not supported by the runner")
    if cfg.get("bias", "none") != "none":
        raise UserError(f"{path}: bias: {cfg['bias']!r} is not supported (trained biases); use bias: none")
    if cfg.get("modules_to_save"):
        raise UserError(f"{path}: modules_to_save {cfg['modules_to_save']} is not supported (only LoRA on "
                        f"{', '.join(PROJECTIONS)})")
    if not isinstance(cfg.get("r", 8), int) or cfg.get("r", 8) < 1:
        raise UserError(f"{path}: r must be a positive integer, got {cfg.get('r')!r}")
    return cfg


def validate_delta(adapter_dir: Path, base_config: dict, base_name: str) -> DeltaSpec:
    """Check a LoRA adapter or full-rank delta against its base's config.json; UserError names
    the first tensor (or setting) that does not fit."""
    adapter_dir = Path(adapter_dir)
    kind = detect_kind(adapter_dir)
    dims = projection_dims(base_config)
    num_layers = int(base_config["num_hidden_layers"])
    cfg = read_lora_config(adapter_dir) if kind == "lora" else {}
    wfile = LORA_WEIGHTS if kind == "lora" else DELTA_WEIGHTS
    header = layout.read_safetensors_header(adapter_dir / wfile)
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if not tensors:
        raise UserError(f"{adapter_dir / wfile}: holds no tensors")
    pattern = _LORA_NAME if kind == "lora" else _DELTA_NAME
    parts: dict[tuple[int, str], dict[str, list[int]]] = {}
    num_parameters = nbytes = 0
    dtypes: dict[str, int] = {}
    for name, t in tensors.items():
        m = pattern.fullmatch(name)
        if m is None:
            expect = ("base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight" if kind == "lora"
                      else "model.layers.<i>.<self_attn|mlp>.<proj>.weight")
            raise UserError(f"{adapter_dir / wfile}: tensor {name!r} is not a projection delta (expected {expect})")
        layer, block, proj = int(m.group(1)), m.group(2), m.group(3)
        if proj not in PROJECTIONS or BLOCK[proj] != block:
            raise UserError(f"{adapter_dir / wfile}: tensor {name!r} targets {block}.{proj}; only "
                            f"{', '.join(PROJECTIONS)} can be targeted")
        if layer >= num_layers:
            raise UserError(f"{adapter_dir / wfile}: tensor {name!r} is for layer {layer} but base {base_name} has "
                            f"{num_layers} layers")
        parts.setdefault((layer, proj), {})[m.group(4) if kind == "lora" else "W"] = list(t["shape"])
        count = math.prod(t["shape"])
        num_parameters += count
        nbytes += int(t["data_offsets"][1]) - int(t["data_offsets"][0])
        dtypes[t["dtype"]] = dtypes.get(t["dtype"], 0) + count
    modules: dict[tuple[int, str], tuple[str, ...]] = {}
    scales: dict[tuple[int, str], float] = {}
    rank = 0
    for (layer, proj), shapes in sorted(parts.items()):
        fin, fout = dims[proj]
        where = f"{adapter_dir / wfile}: layer {layer} {proj}"
        prefix = f"model.layers.{layer}.{BLOCK[proj]}.{proj}"
        if kind == "delta":
            if shapes["W"] != [fout, fin]:
                raise UserError(f"{where}: delta shape {shapes['W']} does not match base {base_name}'s "
                                f"[{fout}, {fin}]")
            modules[(layer, proj)] = (prefix + ".weight",)
            continue
        if set(shapes) != {"A", "B"}:
            missing = "lora_B" if "A" in shapes else "lora_A"
            raise UserError(f"{where}: {missing}.weight is missing")
        a, b = shapes["A"], shapes["B"]
        r = a[0] if len(a) == 2 else -1
        if len(a) != 2 or a[1] != fin:
            raise UserError(f"{where}: lora_A shape {a} does not match base {base_name}: expected [r, {fin}]")
        if len(b) != 2 or b != [fout, r]:
            raise UserError(f"{where}: lora_B shape {b} does not match base {base_name}: expected [{fout}, {r}]")
        want = int(_pattern_value(cfg.get("rank_pattern"), prefix, cfg.get("r", 8)))
        if r != want:
            raise UserError(f"{where}: rank {r} in the tensors but {want} in {LORA_CONFIG}")
        rank = max(rank, r)
        modules[(layer, proj)] = (f"base_model.model.{prefix}.lora_A.weight", f"base_model.model.{prefix}.lora_B.weight")
        scales[(layer, proj)] = lora_scale(cfg, prefix, r)
    targets = sorted({p for _, p in modules}, key=PROJECTIONS.index)
    declared = cfg.get("target_modules")
    if kind == "lora" and isinstance(declared, list) and not set(targets) <= set(declared):
        raise UserError(f"{adapter_dir / LORA_CONFIG}: target_modules {declared} does not list "
                        f"{sorted(set(targets) - set(declared))}, which the tensors target")
    dtype = max(dtypes, key=dtypes.get)
    files = [LORA_CONFIG, LORA_WEIGHTS] if kind == "lora" else [DELTA_WEIGHTS]
    return DeltaSpec(kind=kind, files=files, weights_file=wfile, targets=targets,
                     layers=sorted({layer for layer, _ in modules}), rank=rank, alpha=float(cfg.get("lora_alpha", 0)),
                     num_parameters=num_parameters, dtype=layout.SAFETENSORS_DTYPES.get(dtype, dtype.lower()),
                     nbytes=nbytes, modules=modules, scales=scales)

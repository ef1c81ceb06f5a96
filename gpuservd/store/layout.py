"""What a Hugging Face style model directory must hold, checked without torch.

The store, `import_dir` and the GGUF converter all validate a directory with
`check_dir`, so a model that passed once is judged the same way everywhere.
Safetensors files are inspected through their header only (8-byte length + JSON),
which is enough to count parameters and name the dtype without loading tensors.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from gpuservd.errors import StoreCorrupt, UserError

# The architectures the runner implements; anything else is refused on import.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# config.json fields the runner cannot do without.
REQUIRED_CONFIG_FIELDS = (
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)

SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"

# safetensors dtype tags -> torch dtype names (what ModelInfo.dtype reports).
SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}

# A header bigger than this is a damaged file, not a real model (real ones are < 1 MB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024

# Bounds on the config.json numbers that size allocations, checked before anything is allocated: a
# config saying `num_hidden_layers: 1e8` would otherwise build (and keep) gigabytes of empty layers
# before the weights are found missing. Each bound is far beyond any published model
# (Llama 3.1 405B: 126 layers, hidden 16384, intermediate 53248, vocab 128256).
CONFIG_BOUNDS = {
    "num_hidden_layers": (1, 1024),
    "hidden_size": (1, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (0, 1 << 24),
}


@dataclass
class WeightsSummary:
    """What the safetensors headers of one model say, summed over shards."""

    num_parameters: int  # elements over all stored tensors (tied lm_head not stored, not counted)
    dtype: str  # torch dtype name holding the most elements
    shard_paths: list[Path]  # every safetensors file the model uses


def read_config(model_dir: Path) -> dict:
    """Parse config.json and check the fields the runner needs; StoreCorrupt names the file."""
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreCorrupt(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreCorrupt(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise StoreCorrupt(f"{path}: expected a JSON object")
    missing = [f for f in REQUIRED_CONFIG_FIELDS if f not in config]
    if missing:
        raise StoreCorrupt(f"{path}: missing field(s) {', '.join(missing)}")
    archs = config["architectures"]
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise StoreCorrupt(f"{path}: 'architectures' must be a non-empty list of names")
    check_config_numbers(config, path)
    return config


def check_config_numbers(config: dict, where) -> None:
    """StoreCorrupt unless every sizing field present is an integer within CONFIG_BOUNDS (null = absent)."""
    for key, (lo, hi) in CONFIG_BOUNDS.items():
        v = config.get(key)
        if v is None:
            continue
        if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 53:
            v = int(v)  # 1e3 is written by some tools for 1000
        if isinstance(v, bool) or not isinstance(v, int):
            raise StoreCorrupt(f"{where}: {key} must be an integer, got {str(v)[:40]!r}")
        if not lo <= v <= hi:
            raise StoreCorrupt(f"{where}: {key} = {v} is out of bounds [{lo}, {hi}]; the file is damaged "
                               "or not a model this server can run")
    heads, kv = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if heads and kv and (int(kv) > int(heads) or int(heads) % int(kv)):
        raise StoreCorrupt(f"{where}: num_key_value_heads ({kv}) must divide num_attention_heads ({heads})")


def architecture_of(config: dict) -> str:
    """The first architecture name in a parsed config."""
    return config["architectures"][0]


def require_supported(config: dict, where: Path) -> None:
    """Raise UserError unless the config names an architecture the runner implements."""
    arch = architecture_of(config)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"{where}: architecture {arch} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def read_safetensors_header(path: Path) -> dict:
    """The JSON header of one safetensors file; StoreCorrupt if missing, truncated or malformed."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise StoreCorrupt(f"{path}: truncated (no safetensors header)")
            (size,) = struct.unpack("<Q", head)
            if size > _MAX_HEADER_BYTES:
                raise StoreCorrupt(f"{path}: implausible safetensors header size {size}")
            raw = f.read(size)
            file_size = f.seek(0, 2)
    except FileNotFoundError:
        raise StoreCorrupt(f"{path}: missing") from None
    except OSError as exc:
        raise StoreCorrupt(f"{path}: unreadable ({exc})") from None
    try:
        header = json.loads(raw)
        tensors = {k: t for k, t in header.items() if k != "__metadata__"}
        if not all(isinstance(t["dtype"], str) and isinstance(t["shape"], list) for t in tensors.values()):
            raise TypeError("bad tensor entry")
    except (UnicodeDecodeError, ValueError, AttributeError, KeyError, IndexError, TypeError):
        raise StoreCorrupt(f"{path}: safetensors header is malformed") from None
    data_size = file_size - 8 - size
    for name, t in tensors.items():  # a killed copy leaves a valid header over a short body: caught here
        _check_tensor_entry(path, name, t, data_size)
    return header


def _check_tensor_entry(path: Path, name: str, t: dict, data_size: int) -> None:
    """A tensor's [begin, end) must be integers, in order, and span exactly its shape's bytes; the
    loader slices the file by these numbers, so each must lie inside the file's data section."""
    offsets, shape = t.get("data_offsets"), t["shape"]
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise StoreCorrupt(f"{path}: tensor {name!r}: data_offsets must be two integers, got {str(offsets)[:60]}")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise StoreCorrupt(f"{path}: tensor {name!r}: shape must be non-negative integers, got {str(shape)[:60]}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise StoreCorrupt(f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] are negative or reversed")
    itemsize = DTYPE_BYTES.get(t["dtype"])
    if itemsize is not None:
        numel = 1
        for d in shape:
            numel *= d
        if numel * itemsize != end - begin:
            raise StoreCorrupt(f"{path}: tensor {name!r}: shape {shape} of {t['dtype']} needs {numel * itemsize} "
                               f"bytes but data_offsets span {end - begin}")
    if end > data_size:
        raise StoreCorrupt(f"{path}: tensor {name!r}: data_offsets end {end} lies past the file's {data_size} "
                           "data bytes (truncated or damaged)")


def weight_shards(model_dir: Path) -> list[Path]:
    """The safetensors files a model uses: model.safetensors, else the shards its index names."""
    # Same order as transformers: a single model.safetensors wins over an index.
    single = model_dir / SINGLE_WEIGHTS
    if single.exists():
        return [single]
    index = model_dir / WEIGHTS_INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreCorrupt(f"{index}: not a valid safetensors index ({exc})") from None
        if not all(isinstance(n, str) and n == Path(n).name and not n.startswith(".") for n in names):
            # Shards live beside the index; a path elsewhere is damage (or mischief).
            raise StoreCorrupt(f"{index}: shard names must be plain file names")
        return [model_dir / n for n in names]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        # Several shards and no index: transformers would not find them either.
        raise StoreCorrupt(f"{index}: missing (needed for shards {', '.join(p.name for p in others)})")
    raise StoreCorrupt(f"{single}: missing (no safetensors weights)")


def summarize_weights(model_dir: Path) -> WeightsSummary:
    """Count parameters and find the dominant dtype from every shard's header."""
    shards = weight_shards(model_dir)
    num_parameters = 0
    elements_by_dtype: dict[str, int] = {}
    for shard in shards:
        header = read_safetensors_header(shard)
        for key, tensor in header.items():
            if key == "__metadata__":
                continue
            count = 1
            for dim in tensor["shape"]:
                count *= dim
            num_parameters += count
            dtype = SAFETENSORS_DTYPES.get(tensor["dtype"], tensor["dtype"].lower())
            elements_by_dtype[dtype] = elements_by_dtype.get(dtype, 0) + count
    dtype = max(elements_by_dtype, key=elements_by_dtype.get) if elements_by_dtype else "unknown"
    return WeightsSummary(num_parameters=num_parameters, dtype=dtype, shard_paths=shards)


def check_dir(model_dir: Path) -> tuple[dict, WeightsSummary]:
    """Validate a model directory: config, every weight shard, tokenizer.json.

    Returns the parsed config and the weights summary; raises StoreCorrupt naming
    the first bad file.
    """
    config = read_config(model_dir)
    summary = summarize_weights(model_dir)
    if not (model_dir / TOKENIZER_FILE).is_file():
        raise StoreCorrupt(f"{model_dir / TOKENIZER_FILE}: missing")
    return config, summary


def dir_bytes(model_dir: Path) -> int:
    """Bytes of every regular file under a directory."""
    return sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())

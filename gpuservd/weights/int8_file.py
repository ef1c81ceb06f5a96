"""INT8 weights on disk: a compressed copy of a store model, next to its safetensors.

`<model dir>/int8/model.safetensors` holds each matrix as `<name>.q` (int8),
`<name>.scale` and `<name>.min` (fp16, one each per group of input columns;
weights/quant.py) and every other tensor unchanged. It is written once
(atomically) and read like the original: `Int8Reader.get(name)` returns the
tensor expanded to fp32, so the runner loads from it unchanged; `get_stored`
hands the loader the int8 bytes to expand on the device.

The file says which format it is (`gpuserv_int8` in the safetensors metadata).
A file of another format (the per-row one, format 2's groups of 64, or anything
else) is never read as this one: `Int8Reader` refuses it (`Int8Stale`) and
`ensure_int8` makes it again from the original weights.

`int8/agreement.json` holds how well the INT8 weights keep the model's answers
(engine/agreement.py measures it), tied to the file it was measured on.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gpuservd.errors import StoreCorrupt
from gpuservd.store.readahead import FileReadahead
from gpuservd.store.tensor_file import TensorFile
from gpuservd.weights.quant import GROUP_SIZE, QTensor, quantizable, quantize_int8

log = logging.getLogger("gpuservd.weights")

SUBDIR = "int8"
FILE = "model.safetensors"
AGREEMENT = "agreement.json"
# 1 (no marker): one fp32 scale per row; 2: fp16 scale (and minimum) per 64 input columns, asymmetric;
# 3: fp16 scale and offset per 32 input columns, each group on the better of two grids; 4: the same layout, each
# group on the best of three grids (weights/quant.py): a format-3 file is made again for the values it lacks
FORMAT = "4"
SCHEME = "int8-groupwise-asymmetric-or-symmetric"


class Int8Stale(StoreCorrupt):
    """An INT8 file in another format than this gpuserv writes: make it again, never read it."""


def int8_path(model_dir: Path) -> Path:
    return Path(model_dir) / SUBDIR / FILE


def int8_format(path: Path) -> str | None:
    """The format marker of an INT8 file (None: none, the per-row format had no marker)."""
    with safe_open(str(path), framework="pt") as f:
        return (f.metadata() or {}).get("gpuserv_int8")


def write_int8(reader, model_dir: Path, group_size: int = GROUP_SIZE) -> Path:
    """Quantize every matrix of `reader` into model_dir/int8/ (temp file + rename); returns the path."""
    out = int8_path(model_dir)
    out.parent.mkdir(exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name in reader.names():
        t = reader.get(name)
        if quantizable(name, t):
            qt = quantize_int8(t, group_size)
            tensors[name + ".q"], tensors[name + ".scale"] = qt.q, qt.scale
            if qt.minimum is not None:
                tensors[name + ".min"] = qt.minimum
        else:
            tensors[name] = t.contiguous()
    tmp = out.with_name(f".{FILE}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": "pt", "gpuserv_int8": FORMAT, "scheme": SCHEME,
                                           "group_size": str(group_size), "scale_dtype": "float16"})
    os.replace(tmp, out)
    (out.parent / AGREEMENT).unlink(missing_ok=True)  # measured on the file this one replaces
    return out


def ensure_int8(reader, model_dir: Path) -> Path:
    """The model's INT8 file in this gpuserv's format: written when missing, made again when it is of another
    format (an older gpuserv's) or unreadable; returns its path."""
    path = int8_path(model_dir)
    if path.exists():
        try:
            found = int8_format(path)
        except Exception as exc:  # a torn or foreign file: the original weights are still there
            found = f"unreadable ({exc})"
        if found == FORMAT:
            return path
        log.warning("%s: INT8 weights of format %s, not %s; making them again", path, found or "1 (per-row)", FORMAT)
    return write_int8(reader, model_dir)


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"format": FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_agreement(model_dir: Path, numbers: dict) -> None:
    """Store what engine/agreement.py measured on the current INT8 file."""
    path = int8_path(model_dir)
    target = path.parent / AGREEMENT
    tmp = target.with_name(f".{AGREEMENT}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"int8_file": _stamp(path), **numbers}, indent=2))
    os.replace(tmp, target)


def read_agreement(model_dir: Path) -> dict | None:
    """The stored agreement of the current INT8 file; None when missing or measured on another file."""
    path = int8_path(model_dir)
    try:
        data = json.loads((path.parent / AGREEMENT).read_text())
        return data if data.get("int8_file") == _stamp(path) else None
    except (OSError, ValueError):
        return None


class Int8Reader:
    """Reads an int8/model.safetensors; get() expands to fp32. Same interface as SafetensorsReader."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._f = safe_open(str(self.path), framework="pt")
        except Exception as exc:
            raise StoreCorrupt(f"{self.path}: unreadable INT8 weights ({exc})") from None
        meta = self._f.metadata() or {}
        if meta.get("gpuserv_int8") != FORMAT:
            raise Int8Stale(f"{self.path}: INT8 weights of format {meta.get('gpuserv_int8') or '1 (per-row)'}, "
                            f"this gpuserv reads format {FORMAT}; they are made again on the next int8 load")
        self.group_size = int(meta["group_size"])
        keys = set(self._f.keys())
        self._q = {k[:-2] for k in keys if k.endswith(".q")}
        self._plain = {k for k in keys if not k.endswith((".q", ".scale", ".min"))}
        self._min = {k[:-4] for k in keys if k.endswith(".min")}
        self.bytes_read = 0
        self._readahead = FileReadahead(self.path)
        self._file = TensorFile(self.path)  # positioned reads (the GIL free meanwhile) for the loader

    def names(self) -> list[str]:
        return sorted(self._q | self._plain)

    def prefetch(self, names) -> None:
        """Start reading these tensors' bytes (int8 values and scales) in the background."""
        self._readahead.ask([k for n in names for k in self._keys(n)])

    def _keys(self, name: str) -> tuple[str, ...]:
        if name not in self._q:
            return (name,)
        return (name + ".q", name + ".scale") + ((name + ".min",) if name in self._min else ())

    def has(self, name: str) -> bool:
        return name in self._q or name in self._plain

    def shape(self, name: str) -> list[int]:
        key = name + ".q" if name in self._q else name
        return list(self._f.get_slice(key).get_shape())

    def _qtensor(self, name: str) -> QTensor:
        read = self._file.read
        qt = QTensor(read(name + ".q"), read(name + ".scale"), self.group_size,
                     read(name + ".min") if name in self._min else None)
        self.bytes_read += qt.nbytes
        return qt

    def read_group(self, names, pin: bool = False) -> list:
        """The named tensors as stored, read from the disk (positioned reads: a reader thread's, beside
        the loader; runner/pipeline.py): a QTensor per INT8 matrix, else the tensor (pinned when asked)."""
        parts = []
        for name in names:
            if name in self._q:
                parts.append(self._qtensor(name))
            elif name in self._plain:
                t = self._file.read(name, pin)
                self.bytes_read += t.numel() * t.element_size()
                parts.append(t)
            else:
                raise StoreCorrupt(f"{self.path}: tensor {name!r} is not in the INT8 weights")
        return parts

    def get_stored(self, name: str):
        """As stored: a QTensor for an INT8 matrix (expanded on the device by the loader), else the tensor."""
        return self._qtensor(name) if name in self._q else self.get(name)

    def get(self, name: str) -> torch.Tensor:
        if name in self._q:
            return self._qtensor(name).dequantize(torch.float32)
        if name in self._plain:
            t = self._f.get_tensor(name)
            self.bytes_read += t.numel() * t.element_size()
            return t
        raise StoreCorrupt(f"{self.path}: tensor {name!r} is not in the INT8 weights")

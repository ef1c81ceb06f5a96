"""INT8 weights on disk: a compressed copy of a store model, next to its safetensors (a quarter
of fp32's bytes to read and to move to the device).

`<model dir>/int8/model.safetensors` holds each matrix as `<name>.q` (int8) and
`<name>.scale` (fp32, per output row) and every other tensor unchanged. It is
written once (atomically) and read like the original: `Int8Reader.get(name)`
returns the tensor expanded to fp32, so the runner loads from it unchanged.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from gpuservd.errors import StoreCorrupt
from gpuservd.store.readahead import FileReadahead
from gpuservd.weights.quant import QTensor, quantizable, quantize_int8

SUBDIR = "int8"
FILE = "model.safetensors"


def int8_path(model_dir: Path) -> Path:
    return Path(model_dir) / SUBDIR / FILE


def write_int8(reader, model_dir: Path) -> Path:
    """Quantize every matrix of `reader` into model_dir/int8/ (temp file + rename); returns the path."""
    out = int8_path(model_dir)
    out.parent.mkdir(exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name in reader.names():
        t = reader.get(name)
        if quantizable(name, t):
            qt = quantize_int8(t)
            tensors[name + ".q"], tensors[name + ".scale"] = qt.q, qt.scale
        else:
            tensors[name] = t.contiguous()
    tmp = out.with_name(f".{FILE}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"format": "pt", "gpuserv": "int8-per-row-symmetric"})
    os.replace(tmp, out)
    return out


class Int8Reader:
    """Reads an int8/model.safetensors; get() expands to fp32. Same interface as SafetensorsReader."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self._f = safe_open(str(self.path), framework="pt")
        except Exception as exc:
            raise StoreCorrupt(f"{self.path}: unreadable INT8 weights ({exc})") from None
        keys = set(self._f.keys())
        self._q = {k[:-2] for k in keys if k.endswith(".q")}
        self._plain = {k for k in keys if not (k.endswith(".q") or k.endswith(".scale"))}
        self.bytes_read = 0
        self._readahead = FileReadahead(self.path)

    def names(self) -> list[str]:
        return sorted(self._q | self._plain)

    def prefetch(self, names) -> None:
        """Start reading these tensors' bytes (int8 values and scales) in the background."""
        self._readahead.ask([k for n in names for k in ((n + ".q", n + ".scale") if n in self._q else (n,))])

    def has(self, name: str) -> bool:
        return name in self._q or name in self._plain

    def shape(self, name: str) -> list[int]:
        key = name + ".q" if name in self._q else name
        return list(self._f.get_slice(key).get_shape())

    def get_stored(self, name: str):
        """As stored: a QTensor for an INT8 matrix (expanded on the device by the loader), else the tensor."""
        if name in self._q:
            qt = QTensor(self._f.get_tensor(name + ".q"), self._f.get_tensor(name + ".scale"))
            self.bytes_read += qt.nbytes
            return qt
        return self.get(name)

    def get(self, name: str) -> torch.Tensor:
        if name in self._q:
            qt = QTensor(self._f.get_tensor(name + ".q"), self._f.get_tensor(name + ".scale"))
            self.bytes_read += qt.nbytes
            return qt.dequantize(torch.float32)
        if name in self._plain:
            t = self._f.get_tensor(name)
            self.bytes_read += t.numel() * t.element_size()
            return t
        raise StoreCorrupt(f"{self.path}: tensor {name!r} is not in the INT8 weights")

"""One safetensors file read with positioned reads (pread) into memory the caller owns.

A cold load reads every weight byte once. Reading through the file's memory map (safetensors'
`get_tensor`) faults the pages in one by one on the thread that touches them, so the thread that
casts, expands and packs also waits on the disk, and CPU weights left as views of the map keep
faulting during the first forward. `os.preadv` instead reads a tensor (or a run of tensors that lie
back to back in the file) straight into tensors allocated here, in one system call that releases the
GIL: a reader thread can read the next layers while the loader works on the current one
(runner/pipeline.py), and the bytes read are counted exactly.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from gpuservd.errors import StoreCorrupt

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in the file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # first byte, from the start of the file
    end: int  # one past the last byte


def read_header(path: Path) -> dict[str, TensorEntry]:
    """{key: TensorEntry} from the safetensors header (8-byte little-endian length, then JSON whose
    data_offsets count from the end of the header)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        base = 8 + n
        return {k: TensorEntry(DTYPES[v["dtype"]], tuple(v["shape"]), base + v["data_offsets"][0],
                               base + v["data_offsets"][1])
                for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise StoreCorrupt(f"{path}: unreadable safetensors header ({exc})") from None


def _byte_view(t: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes (any dtype, pinned or not)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class TensorFile:
    """A safetensors file's tensors, read by key into fresh (optionally pinned) CPU tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.entries = read_header(self.path)
        self.bytes_read = 0  # bytes read by read()/read_rows() so far (every thread's)
        self._count = threading.Lock()

    def _entry(self, key: str) -> TensorEntry:
        e = self.entries.get(key)
        if e is None:
            raise StoreCorrupt(f"{self.path}: tensor {key!r} is not in the file")
        numel = 1
        for d in e.shape:
            numel *= d
        if e.end - e.start != numel * torch.tensor([], dtype=e.dtype).element_size():
            raise StoreCorrupt(f"{self.path}: tensor {key!r} spans {e.end - e.start} bytes, not what its shape "
                               f"{list(e.shape)} of {e.dtype} takes")
        return e

    def read(self, key: str, pin: bool = False) -> torch.Tensor:
        """One tensor, read from the disk into memory of its own."""
        e = self._entry(key)
        out = torch.empty(e.shape, dtype=e.dtype, pin_memory=pin)
        self._read_runs([(e, out)])
        return out

    def read_rows(self, keys, pin: bool = False) -> torch.Tensor:
        """The tensors, concatenated along dim 0, read straight into one tensor (no copy after the read).
        They must share a dtype and their trailing dimensions."""
        entries = [self._entry(k) for k in keys]
        first = entries[0]
        if any(e.dtype != first.dtype or e.shape[1:] != first.shape[1:] or not e.shape for e in entries):
            raise StoreCorrupt(f"{self.path}: tensors {list(keys)} cannot be stacked by rows "
                               f"(shapes {[list(e.shape) for e in entries]})")
        out = torch.empty((sum(e.shape[0] for e in entries),) + first.shape[1:], dtype=first.dtype, pin_memory=pin)
        pieces, row = [], 0
        for e in entries:
            pieces.append((e, out[row:row + e.shape[0]]))
            row += e.shape[0]
        self._read_runs(pieces)
        return out

    def _read_runs(self, pieces: list[tuple[TensorEntry, torch.Tensor]]) -> None:
        """Fill each destination with its entry's bytes: one preadv per run of entries that follow each
        other in the file."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            i = 0
            while i < len(pieces):
                j = i + 1
                while j < len(pieces) and pieces[j][0].start == pieces[j - 1][0].end:
                    j += 1
                self._preadv(fd, [(_byte_view(t), e.end - e.start) for e, t in pieces[i:j]], pieces[i][0].start)
                i = j
        finally:
            os.close(fd)

    def _preadv(self, fd: int, bufs: list[tuple[memoryview, int]], offset: int) -> None:
        total = sum(n for _, n in bufs)
        got = os.preadv(fd, [b for b, _ in bufs], offset) if total else 0
        if got < total:  # a short read (a signal, a huge run): finish buffer by buffer
            pos = offset
            for b, n in bufs:
                done = min(max(got - (pos - offset), 0), n)
                while done < n:
                    k = os.preadv(fd, [b[done:]], pos + done)
                    if k <= 0:
                        raise StoreCorrupt(f"{self.path}: the file ends at byte {pos + done}, inside a tensor "
                                           "(truncated)")
                    done += k
                pos += n
        with self._count:
            self.bytes_read += total

"""Reading a load's next tensors ahead: posix_fadvise(WILLNEED) on their byte ranges.

A load reads a safetensors file tensor by tensor through its memory map. Each page fault brings in
little more than the kernel's own readahead window, so the disk idles while the loader copies,
casts or packs what it has. Asking for the next layers' ranges up front starts those reads at
once, in the background, and the loader then finds them in the page cache. Measured on this
project's machine: a TinyLlama-1.1B-shaped bf16 file (2.1 GB) with the page cache dropped, copied
tensor by tensor, took 2.5 s as it was and 1.5 s with two layers asked for ahead. Reading the file
straight through took 1.17 s. A whole bf16 load of it on the CPU (with packing) went from 3.07 to
2.81 s (medians of 3, alternating), in an hour when the disk was slower.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path


def tensor_ranges(path: str | Path) -> dict[str, tuple[int, int]]:
    """{tensor key: (first byte, end byte)} in the file, from the safetensors header (8-byte little-endian
    header length, then the JSON header; data_offsets are relative to the end of the header)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    base = 8 + n
    return {k: (base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def will_need(path: str | Path, ranges) -> None:
    """Start reading these byte ranges of the file in the background (a hint: never raises)."""
    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        for start, end in ranges:
            if end > start:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


class FileReadahead:
    """One safetensors file's tensors, asked for by key; the header is read on the first ask (a file
    whose header cannot be read is simply not read ahead: the load itself says what is wrong)."""

    def __init__(self, path: str | Path):
        self.path = path
        self._ranges: dict[str, tuple[int, int]] | None = None

    def ask(self, keys) -> None:
        if self._ranges is None:
            try:
                self._ranges = tensor_ranges(self.path)
            except (OSError, ValueError, KeyError, struct.error):
                self._ranges = {}
        will_need(self.path, [self._ranges[k] for k in keys if k in self._ranges])

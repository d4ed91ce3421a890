"""Where the daemon's endpoints live when nobody says otherwise."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_fifo_path", "default_runtime_dir", "default_socket_path"]

SOCKET_NAME = "watchdogd.sock"
FIFO_NAME = "timer.fifo"


NODE_RUNTIME_DIR = Path("/run/watchdogd")
"""The node's daemon's (root's, the systemd service's)."""


def default_runtime_dir() -> Path:
    """``/run/watchdogd`` as root, else ``$XDG_RUNTIME_DIR/watchdogd`` or ``/tmp/watchdogd-UID``."""
    if os.geteuid() == 0:
        return NODE_RUNTIME_DIR
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "watchdogd"
    return Path(f"/tmp/watchdogd-{os.geteuid()}")


def default_socket_path() -> Path:
    return default_runtime_dir() / SOCKET_NAME


def found_sockets() -> list[Path]:
    """Where a daemon may listen for this process with nothing configured: this user's
    default, then the node's (the systemd service's), each only if a socket is there."""
    places = dict.fromkeys([default_socket_path(), NODE_RUNTIME_DIR / SOCKET_NAME])
    return [path for path in places if path.is_socket()]


def default_fifo_path() -> Path:
    return default_runtime_dir() / FIFO_NAME

"""Where the daemon's endpoints live when nobody says otherwise."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["default_fifo_path", "default_runtime_dir", "default_socket_path"]

SOCKET_NAME = "watchdogd.sock"
FIFO_NAME = "timer.fifo"


def default_runtime_dir() -> Path:
    """``/run/watchdogd`` as root, else ``$XDG_RUNTIME_DIR/watchdogd`` or ``/tmp/watchdogd-UID``."""
    if os.geteuid() == 0:
        return Path("/run/watchdogd")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "watchdogd"
    return Path(f"/tmp/watchdogd-{os.geteuid()}")


def default_socket_path() -> Path:
    return default_runtime_dir() / SOCKET_NAME


def default_fifo_path() -> Path:
    return default_runtime_dir() / FIFO_NAME

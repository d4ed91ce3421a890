"""watchdogd: a per-node watchdog daemon for GPU training nodes.

The daemon holds deadline timers armed by local processes (over a torch
compatible FIFO and a Unix socket) and kills the processes whose timers
expire. Trainers use the thin client, :mod:`watchdogd_client`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .config import Config, ConfigError, load_config
from .server import Daemon, EndpointError

__all__ = ["Config", "ConfigError", "Daemon", "EndpointError", "__version__", "load_config"]

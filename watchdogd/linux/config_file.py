"""Reading the daemon's TOML config file."""

from __future__ import annotations

import os
from pathlib import Path

from watchdogd.core.config import Config, ConfigError, decode_config

__all__ = ["load_config"]


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read ``path`` (TOML) into a :class:`Config`; None gives the embedded default."""
    if path is None:
        return Config()
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    return decode_config(data, str(path))

"""Config files: defaults, errors that name the key, the shipped example."""

from __future__ import annotations

from pathlib import Path

import pytest

from watchdogd.cli.main import _parser, build_config
from watchdogd.core.config import Config, ConfigError
from watchdogd.linux.config_file import load_config

from ..conftest import REPO


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "watchdogd.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[limits]\nmax_frame = 1\n", "limits.max_frame"),
        ("[limits]\nmax_timers = 'many'\n", "limits.max_timers"),
        ("[limits]\nbogus = 1\n", "bogus"),
        ("[policy]\nprotected_pids = [0]\n", "policy.protected_pids[0]"),
        ("log_level = 'loud'\n", "log_level"),
        ("sockett = '/x'\n", "sockett"),
        ("straggler_threshold = 1.5\n", "straggler_threshold"),
        ("straggler_threshold = 0\n", "straggler_threshold"),
        ("straggler_window = 1\n", "straggler_window"),
        ("straggler_windows = 0\n", "straggler_windows"),
        ("straggler_publish_interval = 0.01\n", "straggler_publish_interval"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text))
    assert key in str(caught.value)
    assert str(tmp_path) in str(caught.value)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError):
        load_config(write(tmp_path, "[limits\n"))


def test_the_shipped_example_is_the_default() -> None:
    assert load_config(REPO / "systemd/watchdogd.toml") == Config()


def test_flags_override_only_what_they_give(tmp_path: Path) -> None:
    config_file = write(tmp_path, "runtime_dir = '/from/file'\nfifo = '/file.fifo'\n")
    args = _parser().parse_args(["serve", "--config", str(config_file), "--socket", "/flag.sock"])
    config = build_config(args)
    assert str(config.socket_path()) == "/flag.sock"
    assert str(config.fifo_path()) == "/file.fifo"
    assert config.runtime_dir == "/from/file"


def test_the_example_group_spec_decodes() -> None:
    import msgspec

    from watchdogd_client.groups import GroupSpec

    spec = msgspec.toml.decode((REPO / "examples/group.toml").read_bytes(), type=GroupSpec)
    assert (spec.name, spec.nproc, spec.max_restarts) == ("toy", 2, 3)

"""Config files: defaults, errors that name the key, the shipped example."""

from __future__ import annotations

from pathlib import Path

import pytest

from watchdogd.cli.main import _parser, build_config
from watchdogd.core.config import (
    AdmissionLimits,
    Config,
    ConfigError,
    FifoSettings,
    LearnedSettings,
    NoisySettings,
    PersistenceSettings,
    PolicyConfig,
    QuerySettings,
    ReaperSettings,
    ScopeSettings,
    SocketSettings,
    StragglerSettings,
    SupervisorSettings,
    TimelineSettings,
    TimerSettings,
    decode_config,
    override,
)
from watchdogd.linux.config_file import load_config
from watchdogd_client.groups import DeadlineRule

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


# Every setting a view carries, each with a value of its own (and none the default), so
# a view that read the wrong key, or the default, fails.
EVERY_VIEWED_SETTING = b"""
stack_dumps = "py-spy"
stack_dump_timeout = 2.5
flight_recorder_timeout = 3.5
scope_stats_half_life = 500
learned_dir = "/learned"
straggler_window = 20
straggler_threshold = 0.7
straggler_windows = 3
straggler_publish_interval = 4.5
timeline_size = 77
snapshot_interval = 1.5
fault_injection = true

[limits]
max_line = 1001
max_frame = 1002
max_scope_len = 13
max_timers_per_pid = 14
max_timers = 15
max_connections = 16
max_connections_per_uid = 17
max_noisy_events_per_s = 18
max_pending_bytes = 4099
max_listed_timers = 19
max_scope_stats_per_uid = 21
max_scope_stats_per_job = 22

[policy]
protected_pids = [23]
fifo_allowed_uids = [24]
allowed_signals = [15]
admin_group = "ops"

[[deadlines]]
scope = "step"
initial = 60
"""


def test_each_view_carries_the_config_values() -> None:
    config = decode_config(EVERY_VIEWED_SETTING, "test")
    policy = PolicyConfig(
        protected_pids=[23], fifo_allowed_uids=[24], allowed_signals=[15], admin_group="ops"
    )
    assert config.timer_settings() == TimerSettings(
        admission=AdmissionLimits(max_scope_len=13, max_timers=15, max_timers_per_pid=14),
        policy=policy,
    )
    assert config.reaper_settings() == ReaperSettings(
        stack_dumps="py-spy", stack_dump_timeout=2.5, flight_recorder_timeout=3.5, kill_grace=10
    )
    assert config.scope_settings() == ScopeSettings(
        max_per_uid=21,
        max_per_job=22,
        half_life=500,
        deadlines=(DeadlineRule(scope="step", initial=60),),
        stragglers=StragglerSettings(window=20, threshold=0.7, windows=3, publish_interval=4.5),
    )
    assert config.socket_settings() == SocketSettings(
        max_connections=16,
        max_connections_per_uid=17,
        max_frame=1002,
        max_pending_bytes=4099,
        admin_group="ops",
    )
    assert config.fifo_settings() == FifoSettings(max_line=1001)
    assert config.noisy_settings() == NoisySettings(max_per_s=18)
    assert config.timeline_settings() == TimelineSettings(size=77)
    assert config.query_settings() == QuerySettings(max_listed=19)
    assert config.persistence_settings() == PersistenceSettings(interval=1.5)
    assert config.learned_settings() == LearnedSettings(directory=Path("/learned"))
    assert config.supervisor_settings() == SupervisorSettings(fault_injection=True)


def test_the_reaper_view_carries_a_kill_grace_of_none() -> None:
    assert Config(kill_grace=None).reaper_settings().kill_grace is None


def test_a_config_changes_only_through_validation() -> None:
    """Frozen, down to its tables: a change is an ``override``, checked as a file's is."""
    config = Config()
    with pytest.raises(AttributeError):
        config.fault_injection = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.limits.max_line = 1  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"reload: limits\.max_line"):
        override(config, "reload", limits={"max_line": 1})
    assert override(config, "reload", timeline_size=5).timeline_settings().size == 5

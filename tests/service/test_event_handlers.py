"""Event handlers named in the config receive the daemon's events; bad names are config errors."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

from watchdogd.core.config import Config, ConfigError
from watchdogd.daemon import Daemon
from watchdogd_client.groups import GroupSpec, GroupState

from ..conftest import running_daemon, wait_for

received: list[dict[str, object]] = []


class Collector(logging.Handler):
    """What an operator's handler might be: here it keeps each event."""

    def emit(self, record: logging.LogRecord) -> None:
        received.append(json.loads(record.getMessage()))


def not_a_handler() -> object:
    return "a string"


@pytest.mark.anyio
async def test_a_handler_named_in_the_config_receives_the_groups_events(short_dir: Path) -> None:
    received.clear()
    spec = GroupSpec(name="quick", entrypoint=[sys.executable, "-c", "pass"], nproc=2)
    settings = {
        "event_log_handler": "collector",
        "event_handlers": {"collector": f"{__name__}:Collector"},
    }
    async with running_daemon(short_dir, **settings) as daemon:
        runner = daemon.supervisor.submit(spec)
        await wait_for(lambda: runner.finished.is_set())
        assert runner.state is GroupState.SUCCEEDED
    names = [event["name"] for event in received]
    assert names[0] == "daemon_started" and names[-1] == "daemon_stopping"
    assert names.count("worker_started") == names.count("worker_exited") == 2
    states = [e["metadata"]["state"] for e in received if e["name"] == "group_state"]  # type: ignore[index]
    assert states == ["HEALTHY", "SUCCEEDED"]
    assert all(event["source"] == "AGENT" for event in received)


@pytest.mark.parametrize(
    ("name", "handlers", "message"),
    [
        ("nope", {}, "event_log_handler 'nope': not torch's (null, console, dynamic_rendezvous)"),
        ("bad", {"bad": "no_such_module_here:X"}, "cannot load 'no_such_module_here:X'"),
        ("bad", {"bad": "no colon"}, "is not a 'module:attribute' reference"),
        ("odd", {"odd": f"{__name__}:not_a_handler"}, "gives a str, not a logging.Handler"),
    ],
)
def test_a_handler_that_cannot_be_had_is_a_config_error(
    short_dir: Path, name: str, handlers: dict[str, str], message: str
) -> None:
    config = Config(runtime_dir=str(short_dir), event_log_handler=name, event_handlers=handlers)
    with pytest.raises(ConfigError) as error:
        Daemon(config)
    assert message in str(error.value)

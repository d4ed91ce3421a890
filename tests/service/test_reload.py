"""A reload reaches every part of a running daemon, and leaves its timers alone.

The daemon runs in-process; the new config changes every setting a part's
view carries (the same values as the config unit tests), and each part is
then asked what it does with it: an arm past the new ``max_scope_len`` or on
a newly protected pid is refused, the noisy events allowed a second follow
the new rate, and so on.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest

from watchdogd.core.config import override
from watchdogd.core.policy import Requester
from watchdogd.core.ports import GroupError
from watchdogd_client.groups import DeadlineRule, Fault

from ..conftest import running_daemon
from ..hostile import sleepers_off_loop
from ..unit.test_config import EVERY_VIEWED_SETTING

_ROOT = Requester("socket", 0, admin=True)


@pytest.mark.anyio
async def test_a_reload_reaches_every_part(short_dir: Path) -> None:
    async with (
        running_daemon(short_dir) as daemon,
        sleepers_off_loop(None, None) as (armed, protected),
    ):
        later = time.time() + 600
        assert daemon.timers.arm(_ROOT, armed.pid, "s" * 14, later, 15) is None
        assert daemon.socket_front.admin_gid is None  # no group "watchdogd" here
        with pytest.raises(GroupError, match="fault injection is disabled"):
            daemon.supervisor.inject("nothing", Fault(kind="kill", rank=0))

        values = msgspec.toml.decode(EVERY_VIEWED_SETTING)
        values["policy"] |= {"protected_pids": [protected.pid], "admin_group": "root"}
        changed = override(daemon.config, "reload", **values)
        daemon.reload(changed)

        assert daemon.config is changed
        assert [t.scope_id for t in daemon.timers.table] == ["s" * 14]  # untouched
        # The timer core: admission (max_scope_len 13) and policy (protected_pids).
        refused = daemon.timers.arm(_ROOT, armed.pid, "t" * 14, later, 15)
        assert refused is not None and "max_scope_len (13)" in refused[1]
        refused = daemon.timers.arm(_ROOT, protected.pid, "t", later, 15)
        assert refused is not None and f"pid {protected.pid} is protected" in refused[1]
        assert daemon.reaper.settings == changed.reaper_settings()
        stats = daemon.scopes.scope_stats
        assert (stats.per_uid, stats.per_job, stats.decay) == (21, 22, 2 ** (-1 / 500))
        assert daemon.scopes.learned.rules == (DeadlineRule(scope="step", initial=60),)
        assert daemon.scopes.learned.per_uid == 21
        board = daemon.scopes.stragglers.board
        assert (board.window, board.threshold, board.windows) == (20, 0.7, 3)
        assert daemon.scopes.stragglers.publish_interval == 4.5
        allowed = [daemon.noisy.allow("bad_input", "fifo", None) for _ in range(20)]
        assert allowed == [True] * 18 + [False] * 2  # max_noisy_events_per_s 18
        assert daemon.timeline.ended.maxlen == 77
        assert daemon.queries.settings.max_listed == 19
        assert daemon.persistence.settings.interval == 1.5
        assert daemon.learned_store.path("job") == Path("/learned/job.json")
        with pytest.raises(GroupError, match="no group named 'nothing'"):
            daemon.supervisor.inject("nothing", Fault(kind="kill", rank=0))
        assert daemon.fifo_front.splitter.max_line == 1001
        assert daemon.socket_front.settings == changed.socket_settings()
        assert daemon.socket_front.admin_gid == 0

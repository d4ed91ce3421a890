"""Which job cgroups a daemon may judge abandoned: named for owners in its own pid namespace."""

from __future__ import annotations

import os
import subprocess

import pytest

from watchdogd.linux import cgroups
from watchdogd.linux.procs import read_stat

INITIAL = 0xEFFFFFFC
CONTAINER = 4026532999


@pytest.fixture
def dead() -> str:
    """``pid-start`` of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    start = read_stat(child.pid).start_time
    child.wait()
    return f"{child.pid}-{start}"


def test_a_job_is_named_for_its_owners_pid_namespace_unless_it_is_the_initial_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mine = f"watchdogd-{os.getpid()}-{read_stat(os.getpid()).start_time}"
    monkeypatch.setattr(cgroups, "_pid_namespace", lambda: INITIAL)
    assert cgroups.job_name().startswith(f"{mine}.")
    monkeypatch.setattr(cgroups, "_pid_namespace", lambda: CONTAINER)
    assert cgroups.job_name().startswith(f"{mine}-ns{CONTAINER}.")


def test_only_an_owner_of_this_pid_namespace_is_judged_gone(
    monkeypatch: pytest.MonkeyPatch, dead: str
) -> None:
    pid = int(dead.split("-")[0])
    monkeypatch.setattr(cgroups, "_pid_namespace", lambda: INITIAL)
    assert cgroups.owner_gone(f"watchdogd-{dead}.1") == pid
    # A container's daemon (pids of its own namespace) beside the host's: not ours to judge.
    assert cgroups.owner_gone(f"watchdogd-{dead}-ns{CONTAINER}.1") is None
    # And from inside the container, neither is the host's.
    monkeypatch.setattr(cgroups, "_pid_namespace", lambda: CONTAINER)
    assert cgroups.owner_gone(f"watchdogd-{dead}.1") is None
    assert cgroups.owner_gone(f"watchdogd-{dead}-ns{CONTAINER}.1") == pid


def test_a_running_owner_is_not_gone() -> None:
    mine = f"watchdogd-{os.getpid()}-{read_stat(os.getpid()).start_time}"
    assert cgroups.owner_gone(cgroups.job_name()) is None
    assert cgroups.owner_gone(f"{mine}.7") is None

"""A daemon alone in its cgroup leaves it for a leaf, so its job cgroup may have memory;
decided on trees built here (a real delegated v2 hierarchy is not needed, nor touched)."""

from __future__ import annotations

from pathlib import Path

import pytest

from watchdogd.linux.cgroups import DAEMON_LEAF, job_base, leave_for_leaf

PID = 4242


def cgroup(path: Path, controllers: str, enabled: str, procs: str) -> Path:
    path.mkdir(parents=True)
    (path / "cgroup.controllers").write_text(controllers + "\n")
    (path / "cgroup.subtree_control").write_text(enabled + "\n")
    (path / "cgroup.procs").write_text(procs)
    return path


@pytest.fixture
def mount(tmp_path: Path) -> Path:
    return cgroup(tmp_path / "cgroup", "cpu io memory pids", "cpu io memory pids", "1\n")


def test_a_daemon_alone_in_its_units_cgroup_moves_to_a_leaf_and_enables_memory(
    mount: Path,
) -> None:
    unit = cgroup(mount / "system.slice/watchdogd.service", "cpu memory pids", "", f"{PID}\n")
    leaf = leave_for_leaf(unit, mount, PID)
    assert leaf == unit / DAEMON_LEAF
    assert (leaf / "cgroup.procs").read_text() == str(PID)
    assert (unit / "cgroup.subtree_control").read_text() == "+memory"
    # Its job cgroups (and a later daemon's sweep) go beside the leaf, not in it.
    assert job_base(leaf) == unit
    assert job_base(unit) == unit


@pytest.mark.parametrize(
    ("controllers", "enabled", "procs", "why"),
    [
        ("cpu pids", "", f"{PID}\n", "no memory controller offered"),
        ("cpu memory pids", "memory", f"{PID}\n", "enabled already"),
        ("cpu memory pids", "", f"{PID}\n977\n", "a shell's cgroup: others live there"),
    ],
)
def test_a_daemon_stays_where_it_is_when_nothing_is_to_gain_or_it_is_not_alone(
    mount: Path, controllers: str, enabled: str, procs: str, why: str
) -> None:
    own = cgroup(mount / "user.slice/session-1.scope", controllers, enabled, procs)
    assert leave_for_leaf(own, mount, PID) is None, why
    assert not (own / DAEMON_LEAF).exists()
    assert (own / "cgroup.subtree_control").read_text() == enabled + "\n"


def test_the_root_cgroup_is_left_as_it_is(tmp_path: Path) -> None:
    # The root may enable controllers with processes in it: no leaf is needed.
    root = cgroup(tmp_path / "cgroup", "cpu memory", "", f"{PID}\n")
    assert leave_for_leaf(root, root, PID) is None
    assert not (root / DAEMON_LEAF).exists()

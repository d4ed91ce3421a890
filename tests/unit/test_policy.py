"""Who may arm timers on which process: the pure rules."""

from __future__ import annotations

import signal

from watchdogd.core.policy import Policy, Requester, Target, check, valid_signals

POLICY = Policy(
    protected_pids=frozenset({1, 100, 50}),
    fifo_allowed_uids=frozenset({1000}),
    allowed_signals=frozenset({signal.SIGKILL, signal.SIGTERM}),
)
ROOT = Requester("socket", 0)
ALICE = Requester("socket", 1000)
BOB = Requester("socket", 1001)
ADMIN = Requester("socket", 1002, admin=True)
FIFO = Requester("fifo")


def test_protected_pids_refused_even_for_root() -> None:
    for pid in (1, 100, 50, 0, -5):
        refusal = check(POLICY, ROOT, Target(pid, 0), signal.SIGKILL)
        assert refusal is not None
        assert "protected" in refusal.reason


def test_kernel_threads_refused() -> None:
    refusal = check(POLICY, ROOT, Target(2000, 0, kernel_thread=True), signal.SIGKILL)
    assert refusal is not None and "kernel thread" in refusal.reason


def test_users_only_target_their_own_uid() -> None:
    assert check(POLICY, ALICE, Target(2000, 1000), signal.SIGKILL) is None
    refusal = check(POLICY, BOB, Target(2000, 1000), signal.SIGKILL)
    assert refusal is not None and "uid 1001" in refusal.reason


def test_root_and_admins_target_anyone_unprotected() -> None:
    assert check(POLICY, ROOT, Target(2000, 1000), signal.SIGKILL) is None
    assert check(POLICY, ADMIN, Target(2000, 1000), signal.SIGKILL) is None


def test_signals_outside_the_allowed_set_refused_but_record_only_allowed() -> None:
    refusal = check(POLICY, ROOT, Target(2000, 0), signal.SIGUSR1)
    assert refusal is not None and "signal" in refusal.reason
    assert check(POLICY, ROOT, Target(2000, 0), 0) is None
    assert check(POLICY, ROOT, Target(2000, 0), -1) is None


def test_fifo_limited_to_allowed_uids_and_supervised() -> None:
    assert check(POLICY, FIFO, Target(2000, 1000), signal.SIGKILL) is None
    assert check(POLICY, FIFO, Target(2000, 0, supervised=True), signal.SIGKILL) is None
    refusal = check(POLICY, FIFO, Target(2000, 0), signal.SIGKILL)
    assert refusal is not None and "fifo_allowed_uids" in refusal.reason


def test_default_signal_set_is_every_valid_signal() -> None:
    assert signal.SIGKILL in valid_signals()
    assert signal.SIGRTMAX in valid_signals()

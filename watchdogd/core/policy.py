"""Who may arm a timer on which process. Pure: the facts come in, a verdict goes out.

Rules
-----
1. Protected targets are refused for everyone: pid 1, the daemon and its
   ancestors, kernel threads, and the configured ``protected_pids``. The
   daemon never signals itself or the tree it hangs from.
2. A signal must be ``<= 0`` (record only, torch semantics) or in
   ``allowed_signals``.
3. Socket peers carry kernel-checked credentials (``SO_PEERCRED``). Root and
   members of the admin group may target any unprotected process; everyone
   else only processes running under their own uid.
4. FIFO requests carry no credentials: whoever can write the FIFO can claim
   any pid. They may target only processes the daemon supervises and
   processes owned by a uid in ``fifo_allowed_uids``.
"""

from __future__ import annotations

import signal as _signal
from typing import Literal

import msgspec

__all__ = ["Policy", "Refusal", "Requester", "Target", "check", "check_pid", "valid_signals"]


def valid_signals() -> frozenset[int]:
    return frozenset(int(s) for s in _signal.valid_signals())


class Requester(msgspec.Struct, frozen=True):
    via: Literal["fifo", "socket"]
    uid: int = -1  # -1: unknown (FIFO)
    admin: bool = False


class Target(msgspec.Struct, frozen=True):
    pid: int
    uid: int
    kernel_thread: bool = False
    supervised: bool = False


class Refusal(msgspec.Struct, frozen=True):
    code: Literal["refused"]
    reason: str


class Policy(msgspec.Struct, frozen=True):
    protected_pids: frozenset[int]
    fifo_allowed_uids: frozenset[int]
    allowed_signals: frozenset[int] = msgspec.field(default_factory=valid_signals)


def _refuse(reason: str) -> Refusal:
    return Refusal("refused", reason)


def check_pid(policy: Policy, pid: int) -> Refusal | None:
    """Rule 1 on the pid alone: asked first, so a protected pid is never even opened."""
    if pid <= 1 or pid in policy.protected_pids:
        return _refuse(f"pid {pid} is protected (init, the daemon, its ancestors or configured)")
    return None


def check(policy: Policy, requester: Requester, target: Target, signal: int) -> Refusal | None:
    """None when ``requester`` may arm a timer with ``signal`` on ``target``."""
    pid = target.pid
    protected = check_pid(policy, pid)
    if protected is not None:
        return protected
    if target.kernel_thread:
        return _refuse(f"pid {pid} is a kernel thread")
    if signal > 0 and signal not in policy.allowed_signals:
        return _refuse(f"signal {signal} is not allowed")
    if requester.via == "socket":
        if requester.admin or requester.uid in (0, target.uid):
            return None
        return _refuse(
            f"uid {requester.uid} may not arm or release timers on pid {pid}, "
            f"which runs as uid {target.uid}"
        )
    if target.supervised or target.uid in policy.fifo_allowed_uids:
        return None
    return _refuse(
        f"FIFO requests may not target pid {pid} (uid {target.uid}): "
        f"not supervised and uid not in fifo_allowed_uids"
    )

"""Admission: whether a request to arm a timer fits the limits. Pure.

Rules
-----
- ``expiration_time`` must be finite; a negative one is a release (torch
  semantics), decided by the caller before admission.
- A scope longer than ``max_scope_len`` is refused.
- A *new* key is refused once the table holds ``max_timers`` or the pid
  holds ``max_timers_per_pid``; re-arming a key it already holds never is,
  so a trainer at its limit can still move its own deadlines.

The other half of arming, who may target which process, is
:mod:`watchdogd.core.policy`; both answer with an error code and a message
for the requester, never an exception.
"""

from __future__ import annotations

import math
from typing import Literal

from watchdogd.core.config import AdmissionLimits
from watchdogd.core.timers import TimerTable

__all__ = ["Rejection", "admit"]

Rejection = tuple[Literal["bad_request", "limit_exceeded"], str]


def admit(
    limits: AdmissionLimits, table: TimerTable, pid: int, scope_id: str, expiration_time: float
) -> Rejection | None:
    """None when arming ``(pid, scope_id)`` fits the limits; else the code and why."""
    if not math.isfinite(expiration_time):
        return "bad_request", f"expiration_time must be finite, got {expiration_time}"
    if len(scope_id) > limits.max_scope_len:
        return "limit_exceeded", (
            f"scope_id of {len(scope_id)} characters exceeds max_scope_len ({limits.max_scope_len})"
        )
    if table.get(pid, scope_id) is not None:
        return None
    if len(table) >= limits.max_timers:
        return "limit_exceeded", f"the daemon holds max_timers ({limits.max_timers})"
    if table.count_for(pid) >= limits.max_timers_per_pid:
        return "limit_exceeded", f"pid {pid} holds max_timers_per_pid ({limits.max_timers_per_pid})"
    return None

"""The event loop's CPU priority: real-time from shortly before a deadline, plain otherwise.

The loop fires every deadline on the node, and on a node whose CPUs the
trainers' data loaders keep busy it would otherwise wait its turn behind
them. From shortly before a deadline until its signals are sent
(:func:`set_loop_urgent`, from the expiry loop) its thread runs
``SCHED_FIFO`` at priority 1: a real-time thread woken on a busy CPU runs
at once. The rest of the time it is a plain thread, because a raised loop
woken by a trainer's request is put on the trainer's CPU (a Unix-socket send
is a synchronous wake-up) and preempts it there: every request would cost
the trainer the loop's whole turn, 20-40 µs instead of 2-3 µs.

On Linux a scheduling policy and a nice value belong to a thread, so only
the loop's thread changes. ``SCHED_RESET_ON_FORK`` makes every thread and
process it starts afterwards (worker threads, workers, helpers, py-spy)
begin as a plain thread at nice 0 or above: nothing inherits the loop's
priority.

Real time needs ``CAP_SYS_NICE`` (root has it) or an ``RLIMIT_RTPRIO`` of 1
(systemd's ``LimitRTPRIO=1``); without either the loop stays plain, and says so.
"""

from __future__ import annotations

import os

__all__ = ["prepare_loop_priority", "set_loop_urgent", "worker_priority"]

_URGENT = os.SCHED_FIFO | os.SCHED_RESET_ON_FORK
_CALM = os.SCHED_OTHER | os.SCHED_RESET_ON_FORK
_switching = False
"""The loop may go real-time (the check at start passed)."""
_urgent = False


def prepare_loop_priority(nice: int | None, realtime: bool) -> str | None:
    """Set up the calling thread (the loop's): ``nice`` (None: as it is), real-time near
    deadlines if ``realtime``. Its future threads and children start plain, at nice >= 0.

    None when done; else what could not be done.
    """
    global _switching, _urgent
    try:
        # The flag first: a thread already above nice 0 without it would pass
        # its priority on to everything it starts.
        os.sched_setscheduler(0, _CALM, os.sched_param(0))
        if nice is not None and os.getpriority(os.PRIO_PROCESS, 0) != nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)  # who=0: this thread only (Linux)
        if realtime:
            os.sched_setscheduler(0, _URGENT, os.sched_param(1))  # may it?
            os.sched_setscheduler(0, _CALM, os.sched_param(0))
    except PermissionError:
        wanted = "real time near deadlines" if realtime else f"nice {nice}"
        return f"the event loop gets no {wanted}: it needs CAP_SYS_NICE (or LimitRTPRIO=1)"
    except OSError as e:
        return f"cannot set the event loop's priority: {e.strerror}"
    _switching, _urgent = realtime, False
    return None


def set_loop_urgent(urgent: bool) -> None:
    """Make the loop thread real-time (a deadline is near) or plain again; on that thread."""
    global _switching, _urgent
    if not _switching or urgent is _urgent:
        return
    try:
        if urgent:
            os.sched_setscheduler(0, _URGENT, os.sched_param(1))
        else:
            os.sched_setscheduler(0, _CALM, os.sched_param(0))
    except OSError:
        _switching = False  # stay as it is from now on
        return
    _urgent = urgent


def worker_priority() -> int:
    """The nice value a process the loop's thread starts begins at (reset on fork: >= 0)."""
    return max(os.getpriority(os.PRIO_PROCESS, 0), 0)

"""The event loop's CPU priority: above the workers it watches, never theirs.

The loop fires every deadline on the node, and on a node whose CPUs the
trainers' data loaders keep busy it would otherwise wait its turn behind
them. On Linux a nice value belongs to a thread, so only the thread that
will run the loop is raised. ``SCHED_RESET_ON_FORK`` makes every thread
and process it starts afterwards (worker threads, workers, helpers,
py-spy) begin at nice 0: the workers never inherit the loop's priority.

Raising it needs ``CAP_SYS_NICE`` (root has it), or systemd's ``Nice=``
with ``CPUSchedulingResetOnFork=yes`` in the unit; without either the
loop stays where it is, and says so.
"""

from __future__ import annotations

import os

__all__ = ["raise_loop_priority", "worker_priority"]

_raised = False


def raise_loop_priority(nice: int) -> str | None:
    """Run the calling thread at ``nice``, its future threads and children at 0.

    None when done (or it already ran at least that high); else why not.
    """
    global _raised
    try:
        # The flag first: a thread already above nice 0 without it would pass
        # its priority on to everything it starts.
        policy = os.sched_getscheduler(0) & ~os.SCHED_RESET_ON_FORK
        os.sched_setscheduler(0, policy | os.SCHED_RESET_ON_FORK, os.sched_getparam(0))
        if os.getpriority(os.PRIO_PROCESS, 0) > nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)  # who=0: this thread only (Linux)
    except PermissionError:
        return f"raising the event loop to nice {nice} needs CAP_SYS_NICE"
    except OSError as e:
        return f"cannot raise the event loop to nice {nice}: {e.strerror}"
    _raised = True
    return None


def worker_priority() -> int:
    """The nice value workers start at: 0 once the loop was raised, else the caller's."""
    return 0 if _raised else os.getpriority(os.PRIO_PROCESS, 0)

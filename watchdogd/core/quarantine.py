"""Setting a bad node aside: which failures are the node's, and when enough were. Pure.

Rules
-----
- A worker's failure points at the node when it was killed by the OOM
  killer, killed by the daemon because its timer expired (a hang), or
  killed by any other signal. A worker that exited with a status of its own
  (a Python exception, with or without torch's error file) failed by the
  program's fault: that is the same on every node, and never counts.
- Only the failure that began a round counts against a node. A hang inside
  a collective fires the timers on every node, and a peer's crash fails the
  other nodes' ranks; so a node counts its failure only if it was first
  twice over: first on the node (its worker failed while the round still
  ran, before the rendezvous told it of any peer), and first in the job
  (its claim on the round's first failure, a create-only key on etcd, was
  the one written). Every node whose failure was first on the node claims,
  whatever the failure's kind, so that a program's exception on one node
  keeps a peer's later signal from counting.
- A node is set aside once ``after`` counted failures fall within
  ``window`` seconds; ``after`` 0 turns the rule off.
"""

from __future__ import annotations

from collections import deque
from typing import Literal

__all__ = ["NodeFailures", "NodeFault", "counts_against_node", "node_fault"]

NodeFault = Literal["oom", "hang", "signal"]
"""What in a worker's failure points at the node."""


def node_fault(exitcode: int, *, oom_kills: int, timer_expired: bool) -> NodeFault | None:
    """Why the failure of a worker that ended with ``exitcode`` (negative: the signal that
    killed it) is the node's; None when it is the program's own."""
    if exitcode == 0:
        return None
    if oom_kills:
        return "oom"
    if timer_expired:
        return "hang"
    if exitcode < 0:
        return "signal"
    return None


def counts_against_node(fault: NodeFault | None, *, first_in_job: bool) -> bool:
    """Whether this node's first failure of a round counts against it: the node's fault,
    and the job's first failure of that round (see the rules)."""
    return fault is not None and first_in_job


class NodeFailures:
    """The counted failures of one node, on the monotonic clock."""

    def __init__(self, after: int, window: float) -> None:
        """``after`` failures within ``window`` seconds set the node aside (0: never)."""
        if after < 0 or window <= 0:
            raise ValueError(f"need after >= 0 and window > 0, got {after}, {window}")
        self.after = after
        self.window = window
        self._times: deque[float] = deque()

    def count(self, now: float) -> bool:
        """Count a failure at ``now``; True when the node must be set aside."""
        if self.after == 0:
            return False
        self._times.append(now)
        while self._times[0] <= now - self.window:
            self._times.popleft()
        return len(self._times) >= self.after

    def __len__(self) -> int:
        """The counted failures within the window, as of the last one."""
        return len(self._times)

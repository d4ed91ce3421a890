"""torch's worker server, started so that the daemon can read this rank's collective trace.

torch serves a rank's flight recorder from outside only through the NCCL
pipe, which no other backend reads, and through its worker server, which it
starts only in ``torch.distributed.elastic.control_plane.worker_main()``.
When the daemon's ``--flight-recorder`` names a socket in
``WATCHDOGD_TRACE_SERVER``, the client starts that same server there once
it connects, if the trainer has imported ``torch.distributed`` by then (the
client never imports torch itself). The server is C++ in a thread of its
own: it answers while the main thread is blocked in a collective, where no
Python signal handler could run. A forked child keeps its parent's server
object, not its thread, and never binds a second one.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings

__all__ = ["serve_trace"]

TRACE_SERVER = "WATCHDOGD_TRACE_SERVER"

# The one server of this process (kept so that it lives as long as the process).
_server: object | None = None


def serve_trace() -> None:
    """Start torch's worker server at ``$WATCHDOGD_TRACE_SERVER``, once, if it can serve."""
    global _server
    path = os.environ.get(TRACE_SERVER)
    if _server is not None or not path or "torch.distributed" not in sys.modules:
        return
    if os.path.lexists(path):
        return  # another process of the rank's (a forked child's parent) serves there
    try:
        c10d = importlib.import_module("torch._C._distributed_c10d")
        _server = c10d._WorkerServer(path)
    except (ImportError, AttributeError, RuntimeError) as e:
        # A trainer runs on without it: only its trace is missed if it hangs.
        warnings.warn(f"watchdogd: cannot serve the collective trace at {path}: {e}", stacklevel=2)

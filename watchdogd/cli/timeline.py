"""``--trace FILE`` of ``watchdogctl events`` and ``watchdogd run``: a job's timeline, written."""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from pathlib import Path

import msgspec

from watchdogd.core.job_trace import EventRecord, SpanRecord, build_trace

__all__ = ["write_trace"]


def write_trace(path: str, events: Sequence[EventRecord], spans: Sequence[SpanRecord]) -> str:
    """Write the Chrome trace of ``events`` and ``spans`` (this node's) to ``path``; a summary.

    OSError when ``path`` cannot be written.
    """
    trace = build_trace(events, spans, hostname=socket.gethostname(), end=time.time())
    Path(path).write_bytes(msgspec.json.encode(trace))
    return f"{len(events)} events and {len(spans)} timers as a Chrome trace in {path}"

"""The FIFO front: torch's newline-delimited JSON, read from the event loop.

The daemon holds the FIFO open read-write and reads it from a loop
callback, in chunks, each line standing alone: a malformed line is reported
as an event and skipped; the lines around it are served.
"""

from __future__ import annotations

import contextlib
import logging
import os

import msgspec

from watchdogd.core.policy import Requester
from watchdogd.service.stats import Stats
from watchdogd.service.timer_service import TimerOperations
from watchdogd_client import protocol as p
from watchdogd_client.framing import OVERSIZED, LineSplitter

__all__ = ["FifoFront"]

log = logging.getLogger("watchdogd")

# Bytes served per loop callback: about a thousand requests, a few ms, so a
# flood cannot hold the expiry loop; the callback runs again on the next
# loop iteration while the pipe holds more.
_READ_CHUNK = 64 << 10
_decoder = msgspec.json.Decoder(p.FileTimerRequest)
_FIFO_REQUESTER = Requester("fifo")


class FifoFront:
    """Serves the FIFO."""

    def __init__(self, timers: TimerOperations, stats: Stats, max_line: int) -> None:
        self.timers = timers
        self.stats = stats
        self.splitter = LineSplitter(max_line)

    def on_readable(self, fd: int) -> None:
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return
        for line in self.splitter.feed(data):
            self._line(line)

    def _line(self, line: bytes) -> None:
        try:
            self._serve_line(line)
        except Exception:
            log.exception("internal error serving a FIFO line: %r", line[:200])

    def _serve_line(self, line: bytes) -> None:
        if line is OVERSIZED:
            self.timers.bad_input(
                "fifo", f"line longer than max_line ({self.splitter.max_line})", b""
            )
            return
        if not line.strip():
            return
        request = self._decode(line)
        if request is None:
            return
        self.stats.requests["fifo"] += 1
        if request.version != 1:
            self.timers.bad_input("fifo", f"unsupported version {request.version}", line[:200])
            return
        error = self.timers.arm(
            _FIFO_REQUESTER,
            request.pid,
            request.scope_id,
            request.expiration_time,
            request.signal,
        )
        if error is not None:
            self.timers.refused("fifo", request.pid, request.scope_id, error)

    def _decode(self, line: bytes) -> p.FileTimerRequest | None:
        try:
            return _decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
            error = e
        # A writer that wrote half a line glues it to the next writer's whole
        # one; every request is a flat object, so the last '{' starts the one
        # worth saving.
        start = line.rfind(b"{")
        salvaged = None
        if start > 0:
            with contextlib.suppress(
                msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError
            ):
                salvaged = _decoder.decode(line[start:])
        self.timers.bad_input("fifo", str(error), line[:start] if salvaged else line)
        return salvaged

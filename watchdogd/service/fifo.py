"""The FIFO front: torch's newline-delimited JSON, read from the event loop.

The daemon holds the FIFO open read-write and reads it from a loop
callback, in chunks, each line standing alone: a malformed line is reported
as an event and skipped; the lines around it are served. At most
``LINES_PER_TURN`` lines are served per loop iteration: the rest of a
chunk waits for the next iteration (the pipe meanwhile holds what is
unread), so a writer flooding the FIFO never holds the loop — and the
expiry loop — for more than a turn; and every ``EXPIRY_CHECK_LINES`` lines
it expires what is due itself, so a kill waits for a few lines at most.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Iterator

import msgspec

from watchdogd.core.config import FifoSettings
from watchdogd.core.policy import Requester
from watchdogd.linux import aio
from watchdogd.service.stats import Stats
from watchdogd.service.timer_core import Audit, TimerOperations
from watchdogd_client import protocol as p
from watchdogd_client.framing import OVERSIZED, LineSplitter

__all__ = ["FifoFront"]

log = logging.getLogger("watchdogd")

# Bytes read at once; of them, lines served per loop iteration (a millisecond
# or two of work, whatever the lines hold: 64 KiB of empty-ish lines is 32,000).
_READ_CHUNK = 64 << 10
LINES_PER_TURN = 64
# Lines served between two looks at the clock for deadlines that passed.
EXPIRY_CHECK_LINES = 16
_decoder = msgspec.json.Decoder(p.FileTimerRequest)
_FIFO_REQUESTER = Requester("fifo")


class FifoFront:
    """Serves the FIFO."""

    def __init__(
        self, timers: TimerOperations, audit: Audit, stats: Stats, settings: FifoSettings
    ) -> None:
        self.timers = timers
        self.audit = audit
        self.stats = stats
        self.splitter = LineSplitter(settings.max_line)
        self._pending: Iterator[bytes] | None = None

    def reconfigure(self, settings: FifoSettings) -> None:
        """A reloaded ``max_line``, from the next line on."""
        self.splitter.max_line = settings.max_line

    def on_readable(self, fd: int) -> None:
        if self._pending is not None:
            return  # the rest of the last chunk first; the pipe keeps what is unread
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return
        self._pending = self.splitter.feed(data)
        self._serve_turn()

    def _serve_turn(self) -> None:
        """Serve up to ``LINES_PER_TURN`` pending lines; come back next iteration for more."""
        pending = self._pending
        assert pending is not None
        timers = self.timers
        served = 0
        for line in itertools.islice(pending, LINES_PER_TURN):
            if not served % EXPIRY_CHECK_LINES:
                timers.expire_due()  # a deadline that passed waits for no turn of ours
            served += 1
            self._line(line)
        if served < LINES_PER_TURN:
            self._pending = None
        else:
            aio.call_soon(self._serve_turn)

    def _line(self, line: bytes) -> None:
        try:
            self._serve_line(line)
        except Exception:
            log.exception("internal error serving a FIFO line: %r", line[:200])

    def _serve_line(self, line: bytes) -> None:
        if line is OVERSIZED:
            self.audit.bad_input(
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
            self.audit.bad_input("fifo", f"unsupported version {request.version}", line[:200])
            return
        error = self.timers.arm(
            _FIFO_REQUESTER,
            request.pid,
            request.scope_id,
            request.expiration_time,
            request.signal,
        )
        if error is not None:
            self.audit.refused("fifo", request.pid, request.scope_id, error)

    def _decode(self, line: bytes) -> p.FileTimerRequest | None:
        try:
            return _decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
            # Its text, not the exception: kept past the except block, the exception
            # and its traceback's frame (whose local it is) make a cycle, and a
            # flood of bad lines made the garbage collector's pauses ~2 ms each.
            reason = str(e)
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
        self.audit.bad_input("fifo", reason, line[:start] if salvaged else line)
        return salvaged

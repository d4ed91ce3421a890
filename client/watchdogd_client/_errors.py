"""Everything the client raises, in one tree::

    WatchdogError
    ├── NotConfiguredError (also RuntimeError)  no client given and none in the environment
    ├── DaemonUnavailableError (also BrokenPipeError)  the socket or FIFO is not there / went away
    ├── ProtocolError  the daemon speaks another protocol version, or sent garbage
    ├── RequestError  the daemon refused or could not process a request
    └── FifoFullError (also BlockingIOError)  the FIFO stayed full for the whole wait

``RequestError`` carries the daemon's stable ``code`` (see
:data:`watchdogd_client.protocol.ERROR_CODES`) and the ``seq`` of the request.
"""

from __future__ import annotations

__all__ = [
    "DaemonUnavailableError",
    "FifoFullError",
    "NotConfiguredError",
    "ProtocolError",
    "RequestError",
    "WatchdogError",
]


class WatchdogError(Exception):
    """Base of every error raised by ``watchdogd_client``."""


class NotConfiguredError(WatchdogError, RuntimeError):
    """``expires`` found no client: nothing configured, nothing in the environment."""


class DaemonUnavailableError(WatchdogError, BrokenPipeError):
    """The daemon's socket or FIFO cannot be reached at ``path``.

    A ``BrokenPipeError`` (so a ``ConnectionError``), as what torch's
    ``FileTimerClient`` raises when no server reads its FIFO: code written
    for torch's client catches it unchanged.
    """

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"watchdogd is not reachable at {path}: {reason}")
        self.path = path
        self.reason = reason


class ProtocolError(WatchdogError):
    """The daemon answered something this client cannot understand."""


class RequestError(WatchdogError):
    """The daemon reported that a request failed."""

    def __init__(self, code: str, message: str, seq: int) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.seq = seq


class FifoFullError(WatchdogError, BlockingIOError):
    """The FIFO had no room for the whole wait; the request was not delivered."""

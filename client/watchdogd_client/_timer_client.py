"""torch's ``TimerClient``, the interface every transport implements."""

from __future__ import annotations

import abc
import time
from typing import Any

__all__ = ["TimerClient", "acquire_learned"]


class TimerClient(abc.ABC):
    """torch's ``TimerClient``: arm and disarm timers for the calling worker."""

    @abc.abstractmethod
    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arm the timer ``scope_id`` to expire at ``expiration_time`` (``time.time()``)."""

    @abc.abstractmethod
    def release(self, scope_id: str) -> None:
        """Disarm the timer ``scope_id``."""

    def acquire_learned(self, scope_id: str, initial: float | None) -> None:
        """Arm ``scope_id`` with a learned deadline (``LEARN``), or ``initial`` seconds from now.

        This transport carries only ``expiration_time`` (torch's format), so it
        cannot learn: it arms ``initial`` seconds from now, and refuses a
        ``LEARN`` without one. :class:`SocketTimerClient` learns.
        """
        acquire_learned(self, scope_id, initial)


def acquire_learned(client: Any, scope_id: str, initial: float | None) -> None:
    """What a client that cannot learn (ours over the FIFO, or torch's) does with ``LEARN``."""
    if initial is None:
        raise ValueError(
            f"{type(client).__name__} sends only an expiration time (torch's format), so it "
            f"cannot learn the deadline of {scope_id!r}: give LEARN(initial=SECONDS), or "
            "use SocketTimerClient"
        )
    client.acquire(scope_id, time.time() + initial)

"""torch's ``TimerClient``, the interface every transport implements."""

from __future__ import annotations

import abc

__all__ = ["TimerClient"]


class TimerClient(abc.ABC):
    """torch's ``TimerClient``: arm and disarm timers for the calling worker."""

    @abc.abstractmethod
    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Arm the timer ``scope_id`` to expire at ``expiration_time`` (``time.time()``)."""

    @abc.abstractmethod
    def release(self, scope_id: str) -> None:
        """Disarm the timer ``scope_id``."""

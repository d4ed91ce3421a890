"""``LEARN``: a deadline the daemon derives from how long the scope took before."""

from __future__ import annotations

import math
from typing import Final

__all__ = ["LEARN", "Learn"]


class Learn:
    """``expires(after=LEARN, scope=...)`` or ``after=LEARN(initial=600)``.

    The daemon resolves the deadline when it arms the timer, from the
    scope's history (see ``DeadlineRule``): ``initial`` seconds (this call's,
    else the rule's) until the attempt has enough samples, then a margin over
    the longest duration seen. Only the socket carries it; a FIFO client
    arms ``initial`` seconds from now and cannot learn.
    """

    __slots__ = ("initial",)

    def __init__(self, initial: float | None = None) -> None:
        if initial is not None and not (math.isfinite(initial) and initial > 0):
            raise ValueError(f"LEARN(initial=...) must be positive seconds, not {initial!r}")
        self.initial = initial

    def __call__(self, initial: float | None = None) -> Learn:
        return Learn(initial)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Learn) and other.initial == self.initial

    def __hash__(self) -> int:
        return hash((Learn, self.initial))

    def __repr__(self) -> str:
        return "LEARN" if self.initial is None else f"LEARN(initial={self.initial!r})"


LEARN: Final = Learn()

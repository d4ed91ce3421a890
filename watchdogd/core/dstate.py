"""Spotting workers stuck in uninterruptible sleep (``D``). Pure: samples in, verdicts out.

A process reads ``D`` for a moment in ordinary life (exec, page faults,
a disk flush), so one sample proves nothing. A worker is *stuck* only when
every sample over ``timeout`` seconds read ``D`` — at least two samples —
and any other state in between starts the count again.
"""

from __future__ import annotations

__all__ = ["DStateDetector"]


class DStateDetector:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._since: dict[int, float] = {}
        self._samples: dict[int, int] = {}

    def observe(self, states: dict[int, str], now: float) -> list[int]:
        """Record one sample (``key -> state letter``); the keys stuck past the timeout."""
        stuck = []
        for key, state in states.items():
            if state != "D":
                self._since.pop(key, None)
                self._samples.pop(key, None)
                continue
            since = self._since.setdefault(key, now)
            count = self._samples[key] = self._samples.get(key, 0) + 1
            if count >= 2 and now - since >= self.timeout:
                stuck.append(key)
        for key in self._since.keys() - states.keys():
            del self._since[key]
            del self._samples[key]
        return stuck

    def sample_interval(self) -> float:
        """How often to sample: several samples per timeout, at most once a second."""
        return min(1.0, self.timeout / 4)

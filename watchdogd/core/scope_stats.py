"""How long each named scope takes, per job and rank: constant-memory sketches. Pure.

Rules
-----
- A released timer adds one sample, its held time, to the sketch of
  ``(job, scope, rank)``: the job is the worker group of a supervised process
  (its rank the global rank), else empty (the rank is then the pid). Expired
  and dropped timers add nothing: a hang is not a duration.
- A :class:`DurationSketch` is a histogram on logarithmic buckets, each 2 %
  wide (DDSketch's scheme), from 10 µs to about 11 days: any quantile it
  reports is within 2 % of a sample's true value, in at most 634 counters
  however many samples came. Its maximum decays: each sample multiplies it
  by ``2 ** (-1 / half_life)`` before taking the new sample's value if
  larger, so an outlier is forgotten after a few half-lives of samples, not
  kept for ever.
- Scope names come from clients, so the sketches are capped: at most
  ``per_uid`` for one uid and ``per_job`` for one job. A sample that would
  need a new sketch past a cap is refused and counted (``refused``); the
  sketches already there keep counting.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["DurationSketch", "ScopeKey", "ScopeStats"]

_ACCURACY = 0.02
_GAMMA = (1 + _ACCURACY) / (1 - _ACCURACY)
_LOG_GAMMA = math.log(_GAMMA)
_SMALLEST = 1e-5
_OFFSET = math.ceil(math.log(_SMALLEST) / _LOG_GAMMA)
_BUCKETS = math.ceil(math.log(1e6) / _LOG_GAMMA) - _OFFSET + 1


class DurationSketch:
    """Quantiles and a decayed maximum of durations (seconds), in bounded memory."""

    __slots__ = ("count", "counts", "decayed_max", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0.0
        self.decayed_max = 0.0
        self.counts: dict[int, int] = {}
        """Bucket index -> samples in it (sparse; at most ``_BUCKETS`` entries)."""

    def add(self, seconds: float, decay: float) -> None:
        """Add one sample; ``decay``: the maximum's factor per sample (``2 ** (-1/half_life)``)."""
        seconds = max(seconds, 0.0)
        bucket = math.ceil(math.log(max(seconds, _SMALLEST)) / _LOG_GAMMA) - _OFFSET
        index = max(0, min(_BUCKETS - 1, bucket))
        self.counts[index] = self.counts.get(index, 0) + 1
        self.count += 1
        self.total += seconds
        self.decayed_max = max(seconds, self.decayed_max * decay)

    def quantile(self, q: float) -> float:
        """The duration below which a fraction ``q`` of the samples lie (0 when empty)."""
        if not self.count:
            return 0.0
        rank = q * (self.count - 1)
        seen = 0
        for index in sorted(self.counts):
            seen += self.counts[index]
            if seen > rank:
                # The bucket's midpoint in relative terms: within _ACCURACY of any sample in it.
                return 2 * _GAMMA ** (index + _OFFSET) / (_GAMMA + 1)
        return 0.0  # unreachable: the counts sum to count


class ScopeKey(NamedTuple):
    job: str
    scope: str
    rank: int


class ScopeStats:
    """Every sketch, keyed by :class:`ScopeKey`, with the caps in the module docstring."""

    def __init__(self, *, per_uid: int, per_job: int, half_life: float = 10_000) -> None:
        self.per_uid = per_uid
        self.per_job = per_job
        self.decay = 2 ** (-1 / half_life)
        self.sketches: dict[ScopeKey, DurationSketch] = {}
        self.owners: dict[ScopeKey, int] = {}
        self.refused = 0
        self._by_uid: dict[int, int] = {}
        self._by_job: dict[str, int] = {}
        self._by_rank: dict[tuple[str, int], list[ScopeKey]] = {}

    def __len__(self) -> int:
        return len(self.sketches)

    def reconfigure(self, *, per_uid: int, per_job: int, half_life: float) -> None:
        """Caps for the sketches still to come (none is dropped), decay from the next sample."""
        self.per_uid = per_uid
        self.per_job = per_job
        self.decay = 2 ** (-1 / half_life)

    def add(self, key: ScopeKey, uid: int, seconds: float) -> bool:
        """Add a sample to ``key``'s sketch; False (counted) when a cap refuses a new one."""
        sketch = self.sketches.get(key)
        if sketch is None:
            if self._by_uid.get(uid, 0) >= self.per_uid or (
                key.job and self._by_job.get(key.job, 0) >= self.per_job
            ):
                self.refused += 1
                return False
            sketch = self.sketches[key] = DurationSketch()
            self.owners[key] = uid
            self._by_uid[uid] = self._by_uid.get(uid, 0) + 1
            self._by_rank.setdefault((key.job, key.rank), []).append(key)
            if key.job:
                self._by_job[key.job] = self._by_job.get(key.job, 0) + 1
        sketch.add(seconds, self.decay)
        return True

    def forget(self, job: str, rank: int) -> None:
        """Drop the sketches of one rank (an unsupervised process that exited: its pid)."""
        for key in self._by_rank.pop((job, rank), []):
            del self.sketches[key]
            uid = self.owners.pop(key)
            self._by_uid[uid] -= 1
            if job:
                self._by_job[job] -= 1

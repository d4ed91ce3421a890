"""Which rank of a job is slow: straggler scores per scope, from released timers. Pure.

Theory of operation
-------------------
The ranks of one job run the same code, so the same scope should take
about as long on each; a rank that is not hung but slower than its peers
(a throttled GPU, a bad NIC, a noisy neighbour) holds back every
synchronous step of the job, and no timer ever fires. So, per
``(job, scope)`` and per rank, the durations of the last ``window``
releases are kept (a sliding window); every ``window // 2`` releases of
that rank once the first window is full (not on every release: the
release path stays one list store) the window's median is compared:

- **relative score** = the fastest rank's window median / this rank's
  (the fastest rank's last scored window, on this node or, in a
  multi-node job, on any node whose fresh summary this node read:
  :attr:`Stragglers.remote`, fed by :mod:`watchdogd.core.job_stragglers`);
- **individual score** = this rank's best window median / its current one
  (the rank against itself: a rank that slows down alone, or a job whose
  every rank slows down).

Both are in (0, 1], 1 being the best. A rank whose lower score is under
``threshold`` for ``windows`` consecutive scorings is flagged, once (a
:class:`Change` comes back); it is cleared, once, after ``windows``
consecutive scorings at or above the threshold. Scoring every half window
finds a rank that slowed down at any point within about one and a half
windows of its releases, where disjoint windows would take up to three. Flagging never kills: the
``straggler`` event is the hook a policy can act on.

Rules
-----
- Only scopes of a job (a supervised worker group: ``ScopeKey.job`` not
  empty) are scored: ranks of one job are comparable, unrelated processes
  are not. The caller adds a sample only where the scope's sketch exists
  (:class:`~watchdogd.core.scope_stats.ScopeStats` admitted it), so the
  windows are capped by the sketches' caps: ``window`` floats per sketch.
- A scope that contains a collective cannot separate ranks: every rank
  waits in it for the slowest, so each takes the same wall time and the
  slow rank's delay lands on its peers. Straggler scopes are the compute
  or data-loading parts before the sync. The host time of a CUDA scope is
  mostly kernel launches (the GPU runs asynchronously); device time, when
  the client reports it, replaces the host time of that rank's scope.
- A rank's window holds one clock: the first device-time sample resets it
  and host samples are ignored from then on; relative scores compare ranks
  on the same clock only.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import NamedTuple

from watchdogd.core.scope_stats import ScopeKey

__all__ = ["Change", "RankWindow", "Stragglers", "ratio"]


class Change(NamedTuple):
    """A rank became flagged (``flagged``) or recovered (not ``flagged``)."""

    key: ScopeKey
    flagged: bool
    relative: float
    individual: float
    windows: int
    """Consecutive scorings that decided it (under, or at or above, the threshold)."""


class RankWindow:
    """One rank's samples of one scope, and its scores since its last completed window."""

    __slots__ = (
        "best",
        "count",
        "device",
        "flagged",
        "individual",
        "median",
        "relative",
        "samples",
        "streak",
        "windows",
    )

    def __init__(self, size: int, device: bool = False) -> None:
        self.samples = [0.0] * size
        self.count = 0
        """Samples taken; the newest is at ``(count - 1) % size``."""
        self.device = device
        self.windows = 0
        """Times scored."""
        self.median = 0.0
        """The last scored window's median (seconds)."""
        self.best = 0.0
        self.relative = 1.0
        self.individual = 1.0
        self.flagged = False
        self.streak = 0
        """Consecutive scorings on the side of the threshold that would change ``flagged``."""


class Stragglers:
    """Every rank's window per ``(job, scope)``, with the scoring in the module docstring."""

    def __init__(self, window: int = 50, threshold: float = 0.85, windows: int = 2) -> None:
        self.window = window
        self.threshold = threshold
        self.windows = windows
        self.scopes: dict[tuple[str, str], dict[int, RankWindow]] = {}
        self.flags = 0
        """Times any rank became flagged (a counter, for the metrics)."""
        self.flagged: set[ScopeKey] = set()
        """The ranks flagged now (a set: the metrics thread copies it in one call)."""
        self.remote: dict[tuple[str, str, bool], float] = {}
        """``(job, scope, device clock)`` -> the fastest window median on the job's other
        nodes, from their fresh summaries (empty for a single-node job)."""

    def configure(self, window: int, threshold: float, windows: int) -> None:
        """New settings; a new window size starts every rank's window (and best) afresh."""
        if window != self.window:
            self.scopes.clear()
            self.flagged.clear()
        self.window, self.threshold, self.windows = window, threshold, windows

    def forget_job(self, job: str) -> None:
        """A new run of ``job``: the last run's windows and flags are not this one's."""
        for key in [key for key in self.scopes if key[0] == job]:
            del self.scopes[key]
        self.flagged = {key for key in self.flagged if key.job != job}
        self.remote = {k: v for k, v in self.remote.items() if k[0] != job}

    def set_remote(self, job: str, fastest: dict[tuple[str, bool], float]) -> None:
        """The other nodes' fastest medians of ``job`` per ``(scope, device clock)``, as of now."""
        self.remote = {k: v for k, v in self.remote.items() if k[0] != job}
        self.remote.update(((job, scope, dev), median) for (scope, dev), median in fastest.items())

    def add(self, key: ScopeKey, seconds: float, device: bool = False) -> Change | None:
        """One sample of ``key``; a :class:`Change` when the scoring it triggered flips a flag."""
        ranks = self.scopes.get((key.job, key.scope))
        if ranks is None:
            ranks = self.scopes[key.job, key.scope] = {}
        rank = ranks.get(key.rank)
        if rank is None or (device and not rank.device):
            rank = ranks[key.rank] = RankWindow(self.window, device)
            self.flagged.discard(key)  # a new window, not flagged yet
        elif rank.device and not device:
            return None  # device time replaces the host time of this rank's scope
        window = self.window
        rank.samples[rank.count % window] = seconds
        rank.count += 1
        if rank.count < window or (rank.count - window) % max(1, window // 2):
            return None
        return self._score(key, ranks, rank)

    def _score(
        self, key: ScopeKey, ranks: dict[int, RankWindow], rank: RankWindow
    ) -> Change | None:
        median = rank.median = statistics.median(rank.samples)
        rank.best = median if rank.windows == 0 else min(rank.best, median)
        rank.windows += 1
        fastest = min(r.median for r in ranks.values() if r.windows and r.device == rank.device)
        elsewhere = self.remote.get((key.job, key.scope, rank.device))
        if elsewhere is not None:
            fastest = min(fastest, elsewhere)
        rank.relative = ratio(fastest, median)
        rank.individual = ratio(rank.best, median)
        low = min(rank.relative, rank.individual) < self.threshold
        # A streak counts windows on the side that would flip the flag.
        rank.streak = rank.streak + 1 if low != rank.flagged else 0
        if rank.streak < self.windows:
            return None
        streak, rank.streak = rank.streak, 0
        rank.flagged = low  # not flagged -> flagged, or flagged -> cleared
        if low:
            self.flags += 1
            self.flagged.add(key)
        else:
            self.flagged.discard(key)
        return Change(key, low, rank.relative, rank.individual, streak)

    def ranks(self) -> Iterator[tuple[ScopeKey, RankWindow]]:
        """Every rank scored at least once, by job, scope and rank."""
        for (job, scope), ranks in sorted(self.scopes.items()):
            for number, rank in sorted(ranks.items()):
                if rank.windows:
                    yield ScopeKey(job, scope, number), rank


def ratio(fast: float, slow: float) -> float:
    """``fast / slow`` in (0, 1]; durations at the clock's floor compare as equal."""
    if slow <= 0:
        return 1.0
    return min(1.0, fast / slow)

"""Learned deadlines: how long a scope may take, from how long it took. Pure.

Rules
-----
- ``expires(after=LEARN)`` arms a timer whose deadline the daemon chooses
  on arm. A *learner* holds what that choice needs: one per (group, scope)
  for a worker group, taught by every rank's releases; one per (pid, scope)
  for a process outside groups, forgotten when it exits. The first
  ``LEARN`` arm of a scope creates it, within ``per_uid`` learners per uid
  (past the cap the call's own initial deadline applies, counted in
  ``refused``).
- Its :class:`~watchdogd_client.groups.DeadlineRule` is the first whose
  pattern matches the scope: the group's rules, then the daemon's, else
  the defaults.
- On release: each rank's first ``skip`` releases of an attempt are not
  learned from (compilation, NCCL set-up); every other one is a sample of
  the attempt (all ranks together), which multiplies the maximum by
  ``2 ** (-1 / half_life)`` and replaces it if larger.
- On arm, while the current attempt has fewer than ``samples`` samples of
  the scope: the call's initial deadline, else the rule's ``initial``;
  with neither the arm is refused. Then ``max(floor, margin * decayed
  maximum)``. A restart within a run keeps what an earlier attempt of the
  run learned: a rank that released its first ``skip`` of the new attempt
  (compilation, NCCL set-up again) is judged by the learned deadline at
  once, not by ``initial`` for ``samples`` more releases.
- A learner lives for one run of its group: a new run of that name starts
  afresh (seeded only by what a ``job_key`` saved), and the learners of a
  run that ended stop counting against the cap (the last
  :data:`ENDED_KEPT` stay visible).
- A group with a ``job_key`` has what it learned saved under that key
  (scopes whose learner reached its samples in some attempt). A saved
  maximum seeds the learner of the next run with that key; that run still
  waits for ``samples`` releases of its own attempt before its deadlines
  are learned ones, so slow first steps are never judged by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Annotated, NamedTuple

import msgspec

from watchdogd_client.groups import DeadlineRule

__all__ = [
    "ENDED_KEPT",
    "LearnKey",
    "LearnedDeadlines",
    "Learner",
    "Resolution",
    "SavedJob",
    "SavedScope",
]

_DEFAULT_RULE = DeadlineRule(scope="*")
ENDED_KEPT = 1000
"""Learners of runs that ended kept for ``watchdogctl scopes``, the latest ones."""


class LearnKey(NamedTuple):
    job: str
    """The worker group; empty outside groups."""
    pid: int
    """0 in a group (its ranks learn together); the process outside groups."""
    scope: str

    @classmethod
    def of(cls, job: str, rank: int, scope: str) -> LearnKey:
        """The learner of ``scope`` for ``rank`` of ``job`` (outside groups: ``rank`` is a pid)."""
        return cls(job, 0, scope) if job else cls("", rank, scope)


class Resolution(NamedTuple):
    seconds: float | None
    """The deadline from now; None: the call's own expiration time."""
    source: str
    """Where it came from, for people: ``initial (call)``, ``initial (rule)``, ``learned``, …"""


class SavedScope(msgspec.Struct, forbid_unknown_fields=True):
    max_s: Annotated[float, msgspec.Meta(ge=0, le=1e7)]
    """A file saying more than ~115 days is not one this daemon wrote."""
    samples: Annotated[int, msgspec.Meta(ge=0)]


class SavedJob(msgspec.Struct, forbid_unknown_fields=True):
    """What one job learned, as saved under its ``job_key``."""

    version: int
    job_key: str
    saved_at: float
    scopes: dict[str, SavedScope]


def match_rule(scope: str, *rule_lists: Sequence[DeadlineRule]) -> DeadlineRule:
    for rules in rule_lists:
        for rule in rules:
            if fnmatchcase(scope, rule.scope):
                return rule
    return _DEFAULT_RULE


class Learner:
    """One scope's history, as far as its deadline needs it."""

    __slots__ = (
        "attempt",
        "decay",
        "decayed_max",
        "group_rules",
        "in_attempt",
        "learned",
        "rule",
        "samples",
        "seeded",
        "skipped",
        "uid",
    )

    def __init__(self, rule: DeadlineRule, group_rules: Sequence[DeadlineRule], uid: int) -> None:
        self.group_rules = group_rules
        self.uid = uid
        self.attempt = -1
        self.in_attempt = 0
        """Samples of the current attempt (all ranks, after their first ``skip``)."""
        self.skipped: dict[int, int] = {}
        """Rank -> its releases of this attempt not learned from (at most ``skip``)."""
        self.samples = 0
        self.decayed_max = 0.0
        self.learned = False
        """Some attempt of this run reached the rule's samples: worth saving, and kept
        across its restarts."""
        self.seeded = False
        self.set_rule(rule)

    def set_rule(self, rule: DeadlineRule) -> None:
        self.rule = rule
        self.decay = 2 ** (-1 / rule.half_life)

    def saved(self) -> SavedScope:
        return SavedScope(self.decayed_max, self.samples)

    def enter(self, attempt: int) -> None:
        if attempt != self.attempt:
            self.attempt = attempt
            self.in_attempt = 0
            self.skipped = {}

    def add(self, seconds: float, rank: int) -> None:
        skipped = self.skipped.get(rank, 0)
        if skipped < self.rule.skip:
            self.skipped[rank] = skipped + 1
            return
        self.in_attempt += 1
        self.samples += 1
        self.decayed_max = max(seconds, self.decayed_max * self.decay)
        if self.in_attempt >= self.rule.samples:
            self.learned = True

    def resolve(self, call_initial: bool, rank: int | None = None) -> Resolution | None:
        """The deadline of ``rank``'s arm now; None when there is none (refuse the arm)."""
        rule = self.rule
        if self.in_attempt < rule.samples and not self._relearning(rank):
            if call_initial:
                return Resolution(None, "initial (call)")
            if rule.initial is not None:
                return Resolution(rule.initial, f"initial (rule {rule.scope!r})")
            return None
        return self.learned_deadline()

    def learned_deadline(self) -> Resolution:
        """The deadline it learned: ``margin`` over the decayed maximum, at least ``floor``
        (this attempt's own once it has its samples, else an earlier attempt's)."""
        rule = self.rule
        learned = rule.margin * self.decayed_max
        if learned < rule.floor:
            return Resolution(rule.floor, "floor")
        if self.in_attempt < rule.samples:
            return Resolution(learned, "learned (an earlier attempt)")
        return Resolution(learned, "learned, seeded" if self.seeded else "learned")

    def _relearning(self, rank: int | None) -> bool:
        """A restarted attempt, ``rank`` past its first ``skip``: the run's deadline holds."""
        return self.learned and rank is not None and self.skipped.get(rank, 0) >= self.rule.skip


class LearnedDeadlines:
    """Every learner, the caps on them, and what is saved per job key."""

    def __init__(self, rules: Sequence[DeadlineRule], *, per_uid: int) -> None:
        self.rules = rules
        self.per_uid = per_uid
        self.learners: dict[LearnKey, Learner] = {}
        self.refused = 0
        self.job_keys: dict[str, str] = {}
        """Group -> its job key, for groups that have one."""
        self.dirty: set[str] = set()
        """Job keys whose saved state is behind."""
        self.to_load: set[str] = set()
        """Job keys whose saved state is wanted and not read yet."""
        self._seeds: dict[str, dict[str, SavedScope]] = {}
        self._by_uid: dict[int, int] = {}
        self._by_pid: dict[int, list[LearnKey]] = {}
        self.ended: dict[LearnKey, Learner] = {}
        """Learners of runs that ended, oldest first (at most :data:`ENDED_KEPT`)."""

    def reconfigure(self, rules: Sequence[DeadlineRule], per_uid: int) -> None:
        self.rules = rules
        self.per_uid = per_uid
        for key, learner in self.learners.items():
            learner.set_rule(match_rule(key.scope, learner.group_rules, rules))

    def resolve(
        self,
        key: LearnKey,
        uid: int,
        attempt: int,
        *,
        call_initial: bool,
        group_rules: Sequence[DeadlineRule] = (),
        job_key: str | None = None,
        rank: int | None = None,
    ) -> Resolution | str:
        """The deadline of a ``LEARN`` arm of ``key`` by ``rank`` (a group's worker's), or
        why it is refused."""
        learner = self.learners.get(key)
        if learner is None:
            if self._by_uid.get(uid, 0) >= self.per_uid:
                self.refused += 1
                if call_initial:
                    return Resolution(None, "initial (call): too many learned scopes")
                return (
                    f"uid {uid} has max_scope_stats_per_uid ({self.per_uid}) learned scopes: "
                    f"give {key.scope!r} LEARN(initial=SECONDS)"
                )
            learner = self._create(key, uid, group_rules, job_key)
        learner.enter(attempt)
        resolution = learner.resolve(call_initial, rank)
        if resolution is None:
            rule = learner.rule
            return (
                f"scope {key.scope!r} has no learned deadline yet ({learner.in_attempt} of "
                f"{rule.samples} samples this attempt) and no initial one: give "
                "LEARN(initial=SECONDS), or an initial in a [[deadlines]] rule matching it"
            )
        return resolution

    def _create(
        self,
        key: LearnKey,
        uid: int,
        group_rules: Sequence[DeadlineRule],
        job_key: str | None,
    ) -> Learner:
        learner = Learner(match_rule(key.scope, group_rules, self.rules), group_rules, uid)
        self.learners[key] = learner
        self._by_uid[uid] = self._by_uid.get(uid, 0) + 1
        if key.pid:
            self._by_pid.setdefault(key.pid, []).append(key)
        if job_key is not None and key.job:
            self.job_keys[key.job] = job_key
            seeds = self._seeds.get(job_key)
            if seeds is None:
                self.to_load.add(job_key)
            elif key.scope in seeds:
                self._seed(learner, seeds[key.scope])
        return learner

    @staticmethod
    def _seed(learner: Learner, saved: SavedScope) -> None:
        learner.decayed_max = max(learner.decayed_max, saved.max_s)
        learner.samples += saved.samples
        learner.seeded = True

    def observe(self, key: LearnKey, attempt: int, seconds: float, rank: int) -> None:
        """A release of ``key`` by ``rank`` that took ``seconds``, if the scope is learned."""
        learner = self.learners.get(key)
        if learner is None:
            return
        learner.enter(attempt)
        learner.add(seconds, rank)
        job_key = self.job_keys.get(key.job)
        if job_key is not None and learner.learned:
            self.dirty.add(job_key)

    def loaded(self, job_key: str, saved: SavedJob | None) -> None:
        """What was saved under ``job_key`` (None: nothing): seeds its groups' learners."""
        self.to_load.discard(job_key)
        seeds = self._seeds[job_key] = {} if saved is None else dict(saved.scopes)
        for key, learner in self.learners.items():
            if self.job_keys.get(key.job) == job_key and key.scope in seeds:
                self._seed(learner, seeds[key.scope])

    def saved(self, job_key: str) -> dict[str, SavedScope]:
        """What to save under ``job_key``: the scopes saved before, updated by those learned."""
        scopes = dict(self._seeds.get(job_key, {}))
        for key, learner in self.learners.items():
            if learner.learned and self.job_keys.get(key.job) == job_key:
                scopes[key.scope] = learner.saved()
        return scopes

    def forget_pid(self, pid: int) -> None:
        """A process outside groups exited: its learners go."""
        for key in self._by_pid.pop(pid, []):
            learner = self.learners.pop(key)
            self._by_uid[learner.uid] -= 1

    def forget_group(self, group: str) -> None:
        """A new run of ``group``: an earlier run's learners (saved first) are not its own."""
        self.retire_group(group)
        self.ended = {key: learner for key, learner in self.ended.items() if key.job != group}

    def retire_group(self, group: str) -> None:
        """``group``'s run ended: what it learned goes to its saved state, the cap frees up."""
        job_key = self.job_keys.pop(group, None)
        for key in [key for key in self.learners if key.job == group]:
            learner = self.learners.pop(key)
            self._by_uid[learner.uid] -= 1
            if job_key is not None and learner.learned:
                seeds = self._seeds.setdefault(job_key, {})
                seeds[key.scope] = learner.saved()
                self.dirty.add(job_key)
            self.ended[key] = learner
        while len(self.ended) > ENDED_KEPT:
            del self.ended[next(iter(self.ended))]

    def describe(self, key: LearnKey) -> Resolution | None:
        """The deadline a ``LEARN`` arm of ``key`` gets now (None: not learned here)."""
        learner = self.learners.get(key) or self.ended.get(key)
        if learner is None:
            return None
        rule = learner.rule
        if learner.in_attempt < rule.samples and not learner.learned:
            return Resolution(rule.initial, f"learning ({learner.in_attempt} of {rule.samples})")
        return learner.learned_deadline()

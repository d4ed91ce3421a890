"""Learned deadlines (core): initial while learning, then margin over the decayed maximum."""

from __future__ import annotations

import random

import msgspec
import pytest

from watchdogd.core.config import ConfigError, decode_config
from watchdogd.core.learned import LearnedDeadlines, LearnKey, Resolution, SavedJob
from watchdogd_client import LEARN, Learn
from watchdogd_client.groups import DeadlineRule, GroupSpec

STEP = LearnKey("llama", 0, "step")


def deadlines(**rule: float) -> LearnedDeadlines:
    return LearnedDeadlines([DeadlineRule(scope="st*", **rule)], per_uid=10)  # type: ignore[arg-type]


def test_the_initial_deadline_holds_until_the_attempt_has_its_samples() -> None:
    learned = deadlines(samples=5, skip=1, margin=2, floor=0, initial=600)
    assert learned.resolve(STEP, 0, 0, call_initial=True) == Resolution(None, "initial (call)")
    assert learned.resolve(STEP, 0, 0, call_initial=False) == Resolution(
        600, "initial (rule 'st*')"
    )
    learned.observe(STEP, 0, 30.0, 0)  # the first step compiles: skipped
    for _ in range(4):
        learned.observe(STEP, 0, 2.0, 0)
    assert learned.resolve(STEP, 0, 0, call_initial=True).source == "initial (call)"  # type: ignore[union-attr]
    learned.observe(STEP, 0, 2.0, 0)
    seconds, source = learned.resolve(STEP, 0, 0, call_initial=True)  # type: ignore[misc]
    assert source == "learned"
    assert seconds == pytest.approx(4.0, rel=1e-3)  # margin 2 x the maximum, not the 30 s


def test_without_any_initial_a_learning_scope_is_refused_with_the_way_out() -> None:
    learned = deadlines(samples=3)
    refusal = learned.resolve(STEP, 0, 0, call_initial=False)
    assert isinstance(refusal, str)
    assert (
        "'step'" in refusal and "LEARN(initial=SECONDS)" in refusal and "0 of 3 samples" in refusal
    )


def test_a_restart_keeps_the_runs_deadline_once_a_rank_is_past_its_skip() -> None:
    learned = deadlines(samples=3, skip=1, floor=0, initial=600)
    learned.resolve(STEP, 0, 0, call_initial=False, rank=0)
    for seconds in (20.0, 1.0, 3.0, 1.0):  # the first compiles: skipped
        learned.observe(STEP, 0, seconds, 0)
    assert learned.resolve(STEP, 0, 0, call_initial=False, rank=0) == Resolution(
        pytest.approx(6.0, rel=1e-3), "learned"
    )
    # Attempt 1: each rank's first step (compiling again) gets the initial deadline...
    assert learned.resolve(STEP, 0, 1, call_initial=False, rank=0) == Resolution(
        600, "initial (rule 'st*')"
    )
    # (`watchdogctl scopes` shows the deadline the ranks past their first step get.)
    shown, source = learned.describe(STEP)  # type: ignore[misc]
    assert (shown, source) == (pytest.approx(6.0, rel=1e-3), "learned (an earlier attempt)")
    learned.observe(STEP, 1, 25.0, 0)
    # ...then the run's learned one at once, not initial for 3 more samples.
    seconds, source = learned.resolve(STEP, 0, 1, call_initial=False, rank=0)  # type: ignore[misc]
    assert (seconds, source) == (pytest.approx(6.0, rel=1e-3), "learned (an earlier attempt)")
    assert learned.resolve(STEP, 0, 1, call_initial=False, rank=1).source.startswith("initial")  # type: ignore[union-attr]
    for _ in range(3):
        learned.observe(STEP, 1, 1.0, 0)
    assert learned.resolve(STEP, 0, 1, call_initial=False, rank=0).source == "learned"  # type: ignore[union-attr]


def test_a_process_outside_groups_learns_again_each_attempt() -> None:
    learned = deadlines(samples=3, skip=0, floor=0)
    learned.resolve(STEP, 0, 0, call_initial=True)
    for seconds in (1.0, 3.0, 1.0):
        learned.observe(STEP, 0, seconds, 0)
    assert learned.resolve(STEP, 0, 0, call_initial=True).source == "learned"  # type: ignore[union-attr]
    assert learned.resolve(STEP, 0, 1, call_initial=True).source == "initial (call)"  # type: ignore[union-attr]
    for _ in range(3):
        learned.observe(STEP, 1, 1.0, 0)
    seconds, _ = learned.resolve(STEP, 0, 1, call_initial=True)  # type: ignore[misc]
    assert seconds == pytest.approx(6.0, rel=1e-3)  # the maximum kept


def test_the_floor_and_the_decay() -> None:
    learned = deadlines(samples=1, skip=0, floor=5, half_life=10)
    learned.resolve(STEP, 0, 0, call_initial=True)
    learned.observe(STEP, 0, 1.0, 0)
    assert learned.resolve(STEP, 0, 0, call_initial=True) == Resolution(5, "floor")
    learned.observe(STEP, 0, 100.0, 0)
    for _ in range(10):
        learned.observe(STEP, 0, 1.0, 0)
    seconds, _ = learned.resolve(STEP, 0, 0, call_initial=True)  # type: ignore[misc]
    assert seconds == pytest.approx(100.0, rel=1e-6)  # 2 x 100 halved after one half-life


def test_the_first_matching_rule_applies_the_groups_before_the_daemons() -> None:
    learned = LearnedDeadlines([DeadlineRule(scope="*", samples=7)], per_uid=10)
    group = [DeadlineRule(scope="ckpt", samples=2), DeadlineRule(scope="st[aeiou]p", samples=3)]
    learned.resolve(STEP, 0, 0, call_initial=True, group_rules=group)
    learned.resolve(LearnKey("llama", 0, "eval"), 0, 0, call_initial=True, group_rules=group)
    assert learned.learners[STEP].rule.samples == 3
    assert learned.learners[LearnKey("llama", 0, "eval")].rule.samples == 7


def test_the_cap_on_learners_per_uid_falls_back_to_the_calls_initial() -> None:
    learned = LearnedDeadlines([], per_uid=100)
    for i in range(100_000):
        learned.resolve(LearnKey("", 7, f"s{i}"), 1000, 0, call_initial=True)
    assert len(learned.learners) == 100
    assert learned.refused == 100_000 - 100
    refusal = learned.resolve(LearnKey("", 7, "another"), 1000, 0, call_initial=False)
    assert isinstance(refusal, str) and "max_scope_stats_per_uid" in refusal
    learned.forget_pid(7)
    assert not learned.learners
    assert learned.resolve(LearnKey("", 8, "s0"), 1000, 0, call_initial=True)
    assert len(learned.learners) == 1


def test_a_saved_maximum_seeds_the_next_run_only_after_its_own_samples() -> None:
    rule = [DeadlineRule(scope="step", samples=4, skip=0, floor=0)]
    first = LearnedDeadlines([], per_uid=10)
    first.resolve(STEP, 0, 0, call_initial=True, group_rules=rule, job_key="llama-7b")
    assert first.to_load == {"llama-7b"}
    first.loaded("llama-7b", None)
    for seconds in (2.0, 2.0, 9.0, 2.0):  # one slow outlier the next run should remember
        first.observe(STEP, 0, seconds, 0)
    assert first.dirty == {"llama-7b"}
    saved = SavedJob(1, "llama-7b", 0.0, first.saved("llama-7b"))
    assert saved.scopes["step"].max_s == pytest.approx(9.0, rel=1e-3)

    second = LearnedDeadlines([], per_uid=10)
    second.resolve(STEP, 0, 0, call_initial=True, group_rules=rule, job_key="llama-7b")
    second.loaded("llama-7b", msgspec.json.decode(msgspec.json.encode(saved), type=SavedJob))
    for _ in range(3):
        second.observe(STEP, 0, 2.0, 0)
        outcome = second.resolve(STEP, 0, 0, call_initial=True, group_rules=rule)
        assert outcome == Resolution(None, "initial (call)")  # never from the first samples
    second.observe(STEP, 0, 2.0, 0)
    seconds, source = second.resolve(STEP, 0, 0, call_initial=True, group_rules=rule)  # type: ignore[misc]
    assert source == "learned, seeded"
    assert seconds > 2 * 8.9  # the saved outlier counts; this run alone would give 4 s


def test_a_group_without_a_job_key_saves_nothing() -> None:
    learned = LearnedDeadlines([DeadlineRule(scope="*", samples=1, skip=0)], per_uid=10)
    learned.resolve(STEP, 0, 0, call_initial=True)
    learned.observe(STEP, 0, 1.0, 0)
    assert not learned.to_load and not learned.dirty


def test_each_ranks_first_releases_are_skipped_not_only_the_first_ranks() -> None:
    learned = deadlines(samples=4, skip=1, floor=0)
    learned.resolve(STEP, 0, 0, call_initial=True)
    for rank in range(8):
        learned.observe(STEP, 0, 90.0, rank)  # every rank compiles on its first step
    for rank in range(4):
        learned.observe(STEP, 0, 2.0, rank)
    seconds, source = learned.resolve(STEP, 0, 0, call_initial=True)  # type: ignore[misc]
    assert source == "learned" and seconds == pytest.approx(4.0, rel=1e-3)


def test_a_new_run_of_a_group_learns_afresh_and_an_ended_one_frees_the_cap() -> None:
    rule = [DeadlineRule(scope="step", samples=2, skip=0, floor=0, initial=60)]
    learned = LearnedDeadlines([], per_uid=1)
    learned.resolve(STEP, 0, 0, call_initial=True, group_rules=rule, job_key="llama")
    learned.loaded("llama", None)
    for _ in range(2):
        learned.observe(STEP, 0, 0.5, 0)
    assert learned.resolve(STEP, 0, 0, call_initial=True).source == "learned"  # type: ignore[union-attr]
    learned.retire_group("llama")
    assert not learned.learners and learned.describe(STEP) is not None  # still shown
    assert learned.saved("llama")["step"].max_s == pytest.approx(0.5, rel=1e-3)
    other = LearnKey("other", 0, "step")
    # The cap (1 learner for uid 0) has room again: the rule's initial, not a refusal.
    assert learned.resolve(other, 0, 0, call_initial=False, group_rules=rule) == Resolution(
        60, "initial (rule 'step')"
    )
    learned.forget_group("other")
    learned.forget_group("llama")
    # The next run of "llama" starts at attempt 0 again: its first arm is not the old deadline.
    outcome = learned.resolve(STEP, 0, 0, call_initial=True, group_rules=rule, job_key="llama")
    assert outcome == Resolution(None, "initial (call)")


def test_lognormal_steps_are_never_killed_by_a_learned_deadline() -> None:
    rng = random.Random(5)

    def step() -> float:  # a slow step (5x) now and then, as the warm-up had too
        return rng.lognormvariate(0, 0.1) * (5 if rng.random() < 0.005 else 1)

    learned = deadlines(samples=1000, skip=0, floor=0)
    learned.resolve(STEP, 0, 0, call_initial=True)
    for _ in range(1000):
        learned.observe(STEP, 0, step(), 0)
    for _ in range(20_000):
        seconds, _ = learned.resolve(STEP, 0, 0, call_initial=True)  # type: ignore[misc]
        took = step()
        assert took < seconds
        learned.observe(STEP, 0, took, 0)
    assert seconds < 13  # and a hang is still caught within 13 median steps


@pytest.mark.parametrize(
    ("toml", "where"),
    [
        (b'[[deadlines]]\nscope = "step"\nmargin = 0\n', "deadlines[0].margin"),
        (b'[[deadlines]]\nscope = "st[ep"\n', "deadlines[0]"),
        (b'[[deadlines]]\nscope = ""\n', "deadlines[0]"),
        (b'[[deadlines]]\nscope = "step"\nsamples = 0\n', "deadlines[0].samples"),
    ],
)
def test_bad_rules_name_the_field(toml: bytes, where: str) -> None:
    with pytest.raises(ConfigError) as error:
        decode_config(toml, "watchdogd.toml")
    assert str(error.value).startswith(f"watchdogd.toml: {where}")


def test_a_job_key_is_a_plain_name() -> None:
    with pytest.raises(msgspec.ValidationError, match="job_key"):
        msgspec.convert({"name": "g", "entrypoint": ["x"], "job_key": "../etc"}, GroupSpec)


def test_learn_is_a_value_and_a_call() -> None:
    assert LEARN.initial is None
    assert LEARN(initial=600) == Learn(600)
    assert repr(LEARN(initial=600)) == "LEARN(initial=600)"
    with pytest.raises(ValueError, match="positive"):
        LEARN(initial=-1)

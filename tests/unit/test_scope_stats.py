"""Scope duration sketches: accuracy, the decaying maximum, bounded memory, the caps."""

from __future__ import annotations

import random

from watchdogd.core.scope_stats import DurationSketch, ScopeKey, ScopeStats

NO_DECAY = 1.0


def test_quantiles_are_within_two_percent_of_the_samples() -> None:
    rng = random.Random(7)
    samples = sorted(rng.lognormvariate(0.7, 0.5) for _ in range(20_000))
    sketch = DurationSketch()
    for sample in samples:
        sketch.add(sample, NO_DECAY)
    for q in (0.01, 0.5, 0.9, 0.99):
        true = samples[int(q * (len(samples) - 1))]
        assert abs(sketch.quantile(q) - true) <= 0.021 * true, q
    assert sketch.count == len(samples)
    assert abs(sketch.total / sketch.count - sum(samples) / len(samples)) < 1e-9


def test_memory_stays_bounded_however_wide_the_samples() -> None:
    sketch = DurationSketch()
    for exponent in range(-9, 9):  # 1 ns to 100 Ms: outside the range is clamped
        for step in range(500):
            sketch.add(10.0**exponent * (1 + step / 500), NO_DECAY)
    assert len(sketch.counts) <= 634
    assert sketch.quantile(0.0) > 0 and sketch.quantile(1.0) < 1.1e6


def test_the_maximum_decays_by_half_every_half_life_of_samples() -> None:
    stats = ScopeStats(per_uid=10, per_job=10, half_life=100)
    key = ScopeKey("", "step", 1)
    stats.add(key, 0, 60.0)  # one slow checkpoint
    for _ in range(100):
        stats.add(key, 0, 0.001)
    assert 29.5 < stats.sketches[key].decayed_max < 30.5
    for _ in range(1000):
        stats.add(key, 0, 0.001)
    assert stats.sketches[key].decayed_max < 0.1  # forgotten, not kept for ever


def test_new_scopes_past_a_cap_are_refused_and_counted_while_known_ones_count_on() -> None:
    stats = ScopeStats(per_uid=3, per_job=1_000)
    for index in range(100_000):
        stats.add(ScopeKey("", f"scope-{index}", 42), 1000, 0.01)
    assert len(stats) == 3 and stats.refused == 99_997
    assert stats.add(ScopeKey("", "scope-0", 42), 1000, 0.01)  # an existing one: counted
    assert stats.sketches[ScopeKey("", "scope-0", 42)].count == 2
    assert stats.add(ScopeKey("", "scope-x", 43), 2000, 0.01)  # another uid has its own cap


def test_a_job_has_its_own_cap_across_its_ranks() -> None:
    stats = ScopeStats(per_uid=1_000, per_job=4)
    for rank in range(8):
        stats.add(ScopeKey("train", "step", rank), 1000, 0.01)
    assert len(stats) == 4 and stats.refused == 4


def test_forgetting_a_process_frees_its_place_under_the_cap() -> None:
    stats = ScopeStats(per_uid=2, per_job=10)
    stats.add(ScopeKey("", "a", 100), 1000, 0.01)
    stats.add(ScopeKey("", "b", 100), 1000, 0.01)
    assert not stats.add(ScopeKey("", "a", 101), 1000, 0.01)
    stats.forget("", 100)  # pid 100 exited
    assert len(stats) == 0
    assert stats.add(ScopeKey("", "a", 101), 1000, 0.01)

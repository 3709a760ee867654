"""The time to useful progress after a move (coordinator/progress.py), from the shim's counts of
issued collectives, on a clock of the test's own: known rates in, known times out.  The real
thing runs in test_shim_e2e.py (an NCCL job evacuated, its ledger entry read back)."""

from __future__ import annotations

import math

import pytest

from pitstop.coordinator import progress
from pitstop.coordinator.progress import Sample


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def sleep(self, d: float) -> None:
        self.t += d


def job(starts: dict[str, float], rates: dict[str, float], at_cut: int = 10):
    """Each rank issues its first collective after the move at starts[w], then rates[w] a second."""
    def count(w: str, t: float) -> int:
        if t < starts[w]:
            return at_cut
        return at_cut + math.floor((t - starts[w]) * rates[w] + 1e-9) + 1
    return count


def run(count, clock: Clock, ranks=("a", "b"), before_rate: float | None = 5.0, window: float = 10.0):
    cut = Sample(100.0, {w: 10 for w in ranks})
    before = Sample(98.0, {w: 10 - int(2 * before_rate) for w in ranks}) if before_rate else None
    return progress.watch(lambda: {w: count(w, clock.t) for w in ranks}, cut, 101.0, before, window_s=window,
                          every_s=0.01, now=clock.now, sleep=clock.sleep)


def test_the_first_collectives_and_the_job_back_to_speed():
    clock = Clock(101.0)
    a = run(job({"a": 101.2, "b": 101.3}, {"a": 5.0, "b": 5.0}), clock)
    assert a.measured and a.ranks == 2
    # every rank's second collective: a's at 101.4, b's at 101.5, 0.5 s after the resume
    assert a.first_collectives_s == pytest.approx(0.5, abs=0.011)
    assert a.collectives_per_s_before == pytest.approx(5.0)
    assert a.collectives_per_s_after == pytest.approx(5.0, rel=0.1)
    assert a.step_time_ratio == pytest.approx(1.0, rel=0.1)
    # the trailing second's rate is first 4.5 a rank or more at 102.1: 5 collectives each since 101.1
    assert a.back_to_speed_s == pytest.approx(1.1, abs=0.011)
    assert a.watched_s < 10.0  # it stopped watching once it knew


def test_a_slower_spare_shows_as_longer_steps():
    a = run(job({"a": 101.1, "b": 101.1}, {"a": 5.0, "b": 2.5}), Clock(101.0))
    assert a.step_time_ratio == pytest.approx(5.0 / 3.75, rel=0.08)  # the job's mean rate is now 3.75
    assert a.back_to_speed_s is None  # never back to 90 % of 5 a second


def test_a_rank_that_never_calls_again_is_said_not_measured():
    a = run(job({"a": 101.1, "b": 1e9}, {"a": 5.0, "b": 5.0}), Clock(101.0), window=3.0)
    assert not a.measured and a.first_collectives_s is None
    assert "1 of 2" in a.why_not and "3 s" in a.why_not


def test_no_rate_before_where_the_move_began_too_soon_after_its_sample():
    clock = Clock(101.0)
    cut = Sample(100.0, {"a": 10})
    before = Sample(99.8, {"a": 9})  # 0.2 s: too short to be a rate
    a = progress.watch(lambda: {"a": job({"a": 101.1}, {"a": 5.0})("a", clock.t)}, cut, 101.0, before,
                       window_s=5.0, every_s=0.01, now=clock.now, sleep=clock.sleep)
    assert a.measured and a.collectives_per_s_before is None and a.step_time_ratio is None
    assert a.back_to_speed_s is None


def test_a_read_that_fails_is_only_a_missed_sample():
    clock = Clock(101.0)
    count = job({"a": 101.1}, {"a": 5.0})
    calls = {"n": 0}

    def read():
        calls["n"] += 1
        if calls["n"] % 3 == 0:
            raise OSError("agent busy")
        return {"a": count("a", clock.t)}

    a = progress.watch(read, Sample(100.0, {"a": 10}), 101.0, None, window_s=2.0, every_s=0.01, now=clock.now,
                       sleep=clock.sleep)
    assert a.measured and a.first_collectives_s == pytest.approx(0.3, abs=0.03)

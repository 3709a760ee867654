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


def test_a_step_is_the_shortest_run_of_calls_the_trail_repeats():
    assert progress.ops_per_step([7] * 20) == 1
    assert progress.ops_per_step([1, 2, 3] * 10) == 3
    assert progress.ops_per_step([9, 9] + [1, 2, 2, 3] * 5) == 4  # a start unlike the loop does not count
    assert progress.ops_per_step([2, 3, 1, 2, 3, 1, 2]) is None  # fewer than 3 periods
    assert progress.ops_per_step(list(range(256))) is None
    assert progress.ops_per_step([]) is None


def test_operations_per_step_by_worker_add_up_its_processes_and_want_all_of_them():
    coll = {"issued": 5, "sent": [], "recvd": []}
    blocks = {"w.0": [{"trail": [1, 2] * 6, "comms": [coll]}, {"trail": [4] * 6, "comms": [coll]}],
              "w.1": [{"trail": [1, 2, 3, 4, 5, 6], "comms": [coll]}],  # no period: no step for it
              "w.2": [{"comms": [coll]}],  # a shim with no trail
              "w.3": [{"comms": []}, {"trail": [1, 2] * 6, "comms": [coll]}]}  # a block that never called
    assert progress.per_step_by_worker(blocks) == {"w.0": 3, "w.3": 2}


def test_steps_redone_take_the_snapshots_period_or_else_the_survivors_trails_now():
    def block(issued: int, trail: list[int]) -> dict:
        return {"comms": [{"issued": issued, "sent": [], "recvd": []}], "trail": trail}
    at = {"w.0": 4, "w.1": 4}
    now = {"w.0": [block(44, [1, 2] * 20)], "w.1": [block(46, [1, 2] * 20)]}
    # the snapshot's trails showed the period: it is used
    assert progress.steps_redone(True, at, {"w.0": 2, "w.1": 2}, now, None) == {"ops_redone": 42, "steps_redone": 21.0}
    # a snapshot taken two steps in (four operations: no period yet): the survivors' trails give it
    assert progress.steps_redone(True, at, {}, now, None) == {"ops_redone": 42, "steps_redone": 21.0}
    # nothing shows one: the operations only, and why
    odd = {"w.0": [block(44, list(range(40)))]}
    got = progress.steps_redone(True, at, {}, odd, None)
    assert got["steps_redone"] is None and got["ops_redone"] == 40 and "trails" in got["steps_redone_why"]
    # survivors that had ended have no counters to read: said so, not "no period"
    got = progress.steps_redone(True, at, {}, {"w.0": [], "w.1": []}, None)
    assert got["steps_redone"] is None and "ended" in got["steps_redone_why"]
    assert "could not be read: timed out" in progress.steps_redone(True, at, {}, now, "timed out")["steps_redone_why"]
    assert progress.steps_redone(False, {}, {}, {}, None)["steps_redone"] is None


def test_the_first_full_step_is_a_steps_calls_and_one_more_after_the_cut():
    clock = Clock(101.0)
    # 3 calls a step: from the cut, a rank's 4th call means its 3rd had returned
    cut = Sample(100.0, {"a": 10, "b": 10})
    before = Sample(98.0, {"a": 0, "b": 0}, per_step={"a": 3, "b": 3})
    count = job({"a": 101.2, "b": 101.3}, {"a": 5.0, "b": 5.0})
    a = progress.watch(lambda: {w: count(w, clock.t) for w in "ab"}, cut, 101.0, before, window_s=10.0,
                       every_s=0.01, now=clock.now, sleep=clock.sleep)
    # b's 4th call after the cut: 101.3 + 3 / 5 = 101.9, 0.9 s after the resume
    assert a.first_step_s == pytest.approx(0.9, abs=0.011) and a.ops_per_step == 3
    assert a.first_collectives_s == pytest.approx(0.5, abs=0.011)


def test_no_first_step_unless_every_rank_shows_its_period():
    clock = Clock(101.0)
    cut = Sample(100.0, {"a": 10, "b": 10})
    before = Sample(98.0, {"a": 0, "b": 0}, per_step={"a": 3})
    count = job({"a": 101.1, "b": 101.1}, {"a": 5.0, "b": 5.0})
    a = progress.watch(lambda: {w: count(w, clock.t) for w in "ab"}, cut, 101.0, before, window_s=5.0,
                       every_s=0.01, now=clock.now, sleep=clock.sleep)
    assert a.measured and a.first_step_s is None and a.ops_per_step is None


def test_a_sigstop_pause_per_rank_is_from_its_agents_stop_to_its_running_again():
    stopped = {"a.0": 10.0, "a.1": 10.2, "a.2": 10.3}
    running = {"a.0": 11.0, "a.1": 10.9, "a.2": 10.1}  # a.2's clocks disagree: left out, not negative
    assert progress.pauses_between(stopped, running) == {"a.0": 1.0, "a.1": 0.7}


def test_the_pause_each_rank_saw_is_its_first_park_to_its_last_resume():
    blocks = {"w.0": [{"pause": {"parked": 10.0, "resumed": 11.5}}, {"pause": {"parked": 10.2, "resumed": 11.7}}],
              "w.1": [{"pause": {"parked": 10.1, "resumed": None}}],  # still parked: left out
              "w.2": [{"pause": None}]}
    assert progress.rank_pauses(blocks) == {"w.0": 1.7}


def _block(n: int, at0: float = 50.0, every: float = 0.1, ring: int = 256) -> dict:
    """A block whose process issued n operations, operation i at at0 + i * every."""
    k = min(n, ring)
    return {"trail_n": n, "trail": [1] * k, "trail_at": [at0 + i * every for i in range(n - k, n)]}


def test_the_shims_own_stamps_time_the_first_calls_and_step_exactly():
    cut = Sample(100.0, {"a": 10, "b": 20})
    blocks = {"a": [_block(40)], "b": [_block(40, at0=49.0)]}
    times = progress.op_times(blocks, cut, {"a": 3, "b": 3})
    # a: its 2nd operation after the cut is number 11 (at 51.1), its 4th number 13 (51.3)
    assert times["a"] == pytest.approx((51.1, 51.3)) and times["b"] == pytest.approx((51.1, 51.3))
    watched = progress.AfterMove(measured=True, ranks=2, first_collectives_s=0.2, first_step_s=0.3, ops_per_step=3)
    assert progress.last_resume({"a": [{"pause": {"parked": 50.0, "resumed": 50.9}}],
                                 "b": [{"pause": {"parked": 50.1, "resumed": 51.0}}, {"pause": None}]}) == 51.0
    assert progress.last_resume({"a": [{"pause": None}]}) is None
    exact = progress.with_op_times(watched, times, 51.0)
    assert exact.timed_by == "shim" and exact.first_collectives_s == pytest.approx(0.1)
    assert exact.first_step_s == pytest.approx(0.3)


def test_stamps_the_trail_no_longer_holds_or_a_rank_without_them_leave_the_reads_figures():
    cut = Sample(100.0, {"a": 10, "b": 10})
    # a issued 400 since: its ring holds 144-399 only; b has two NCCL processes (no one trail of all)
    blocks = {"a": [_block(410)], "b": [_block(30), _block(30)]}
    assert progress.op_times(blocks, cut, {"a": 2, "b": 2}) == {}
    # an operation in the ring's oldest entries may have been overwritten as it was read
    assert progress.op_times({"a": [_block(10 + 256)]}, Sample(100.0, {"a": 10}), None) == {}
    assert progress.op_times({"a": [_block(10 + 256 - 20)]}, Sample(100.0, {"a": 10}), None)
    watched = progress.AfterMove(measured=True, ranks=2, first_collectives_s=0.2)
    assert progress.with_op_times(watched, {"a": (51.1, None)}, 51.0) == watched  # b's unknown

"""The ledger's pause (coordinator/ledger.job_pause): the pause the job saw, which after a post-copy
restore lasts past the resume until the job's first step or the end of its memory's fill, whichever
is later.  Before: the ledger and the dashboard gave the downtime (first pause to last resume) for
post-copy moves too, while the job stalled on its memory being filled for longer."""

from __future__ import annotations

from pitstop.coordinator import ledger
from pitstop.wire.evacuation import AfterMove, EvacuationState, WorkerProgress
from pitstop.wire.store_rows import StoredOp

PAUSED, RESUMED = 1000.0, 1001.0  # a downtime of 1 s


def _md(*workers: WorkerProgress, first_step_s: float | None = None, measured: bool = True) -> EvacuationState:
    md = EvacuationState(node="a", destination="s", workers={f"j.{i}": w for i, w in enumerate(workers)},
                         first_pause=PAUSED, last_resume=RESUMED, downtime_s=RESUMED - PAUSED)
    if first_step_s is not None or not measured:
        md.after_move = AfterMove(measured=measured, first_step_s=first_step_s)
    return md


def _eager() -> WorkerProgress:
    return WorkerProgress(job="j", restore_phases={"restore": 0.5})


def _lazy(fill_seconds: float | None, network: bool = False) -> WorkerProgress:
    w = WorkerProgress(job="j", restore_phases={"restore": 0.2, "fill_start": 0.01},
                       bytes_after_resume=5 << 20 if network else None)
    if fill_seconds is not None:  # as the destination's agent reports it, by its clock
        w.fill = {"state": "filled", "started": RESUMED - 0.1, "seconds": fill_seconds + 0.3,
                  "ended": RESUMED - 0.1 + fill_seconds}
    return w


def test_an_eager_move_pauses_the_job_for_its_downtime():
    assert ledger.job_pause(_md(_eager(), first_step_s=0.3)) == (1.0, "last resume")


def test_after_a_post_copy_restore_the_pause_lasts_until_the_fill_ends_for_a_gloo_job():
    assert ledger.job_pause(_md(_lazy(3.1), _lazy(2.0), measured=False)) == (4.0, "fill end")  # 0.9 + 3.1 - 0
    assert ledger.job_pause(_md(_lazy(3.1, network=True))) == (4.0, "fill end")


def test_the_later_of_the_first_step_and_the_fill_end():
    assert ledger.job_pause(_md(_lazy(1.1), first_step_s=2.5)) == (3.5, "first step")
    assert ledger.job_pause(_md(_lazy(4.1), first_step_s=2.5)) == (5.0, "fill end")


def test_what_is_not_known_yet_is_left_out_until_it_is():
    md = _md(_lazy(None), _lazy(2.0))  # one fill still going: no fill end yet
    assert ledger.job_pause(md) == (1.0, "last resume")
    md.after_move = AfterMove(measured=True, first_step_s=1.5)
    assert ledger.job_pause(md) == (2.5, "first step")
    md.workers["j.0"].fill = {"state": "filled", "started": RESUMED - 0.1, "seconds": 6.1}  # an agent without `ended`
    assert ledger.job_pause(md) == (7.0, "fill end")


def test_a_fill_done_by_the_resume_adds_nothing():
    assert ledger.job_pause(_md(_lazy(0.05))) == (1.0, "last resume")


def test_the_ledger_entry_gives_the_jobs_pause_what_ended_it_and_the_downtime():
    md = _md(_lazy(3.1, network=True), first_step_s=0.5)
    e = ledger.entry(StoredOp(id="op-1", node="a", result="succeeded", created=990.0, updated=1010.0,
                              metadata=md.dump()))
    assert (e["pause_s"], e["pause_until"], e["downtime_s"]) == (4.0, "fill end", 1.0)

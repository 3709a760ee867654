"""The audit's M3: a recovery whose database write failed left its operation "running" for good,
with the survivors possibly already stopped; the driver's watchdog covered evacuations only.  The
operations' watchdog (coordinator/operations.py, Operations.watch), which drives evacuations and
recoveries alike, runs such a recovery again from its start once the database takes writes, and
writes the last record of one that ended on the agents.  A real SQLite store, made read-only as a remounted file system would; the recovery's
own work is the one faked part (its end-to-end runs are tests/test_recovery_e2e.py)."""

from __future__ import annotations

import threading

import pytest

from pitstop.coordinator.recovery import Recoveries
from pitstop.coordinator.recovery_run import RecoveryRun
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.sqlitestore import Store
from pitstop.coordinator.store import StoreUnavailable
from pitstop.wire.recovery_state import TYPE_URL

pytestmark = pytest.mark.timeout(60)


class _Snaps:
    lock = threading.Lock()
    pausing: set[str] = set()

    def hold(self, job: str) -> None: ...
    def release(self, job: str) -> None: ...
    def restart_clock(self, job: str, at: float) -> None: ...
    def drop_everywhere(self, job: str, why: str) -> None: ...
    def heard(self, host: str) -> bool: return True


def _read_only(store: Store, on: bool) -> None:
    store.db.execute(f"PRAGMA query_only={int(on)}")


@pytest.fixture
def rec(tmp_path):
    store = Store(tmp_path / "c.db")
    store.create_op("recover-1", "host-b", None, {"@type": TYPE_URL, "job": "train", "node": "host-b",
                                                  "snapshot": 1, "phases": {}, "conditions": []}, None)
    return Recoveries(store, CoordinatorSettings(db=tmp_path / "c.db", watchdog_s=0.05), _Snaps(), lambda: {})


def test_a_recovery_whose_thread_ended_on_a_refused_write_is_run_again_once_the_database_writes(rec, monkeypatch):
    ran: list[str] = []
    stopped = threading.Event()

    def recover(run: RecoveryRun) -> None:
        ran.append(run.id)
        stopped.set()  # the survivors stopped; then the next phase's write is refused
        run.enter("restore", leaving="stop")

    monkeypatch.setattr(RecoveryRun, "drive", recover)
    _read_only(rec.store, True)
    rec.ops.spawn("recover-1", lambda r: r.run())
    rec.ops.threads["recover-1"].join(30)
    assert stopped.is_set() and ran == ["recover-1"]
    assert not rec.store.op("recover-1").done, "left running, with nothing driving it"
    assert rec.ops.watch() == ["recover-1"]  # run again: while the database refuses, it ends so again
    rec.ops.threads["recover-1"].join(30)
    assert not rec.store.op("recover-1").done and len(ran) == 2
    _read_only(rec.store, False)
    rec.ops.runs["recover-1"].next_takeover = 0.0  # past its back-off

    def finishes(run: RecoveryRun) -> None:
        ran.append(run.id)
        run.md.result = "succeeded"
        run.end(done=True, result="succeeded")

    monkeypatch.setattr(RecoveryRun, "drive", finishes)
    assert rec.ops.watch() == ["recover-1"]
    rec.ops.threads["recover-1"].join(30)
    op = rec.store.op("recover-1")
    assert op.done and op.result == "succeeded" and len(ran) == 3
    assert rec.ops.watch() == [] and not rec.ops.runs


def test_a_recovery_over_on_the_agents_is_recorded_not_run_again(rec, monkeypatch):
    ran: list[str] = []

    def finishes(run: RecoveryRun) -> None:
        ran.append(run.id)
        _read_only(rec.store, True)  # its last write is refused
        run.md.result = "succeeded"
        run.end(done=True, result="succeeded")

    monkeypatch.setattr(RecoveryRun, "drive", finishes)
    rec.ops.spawn("recover-1", lambda r: r.run())
    rec.ops.threads["recover-1"].join(30)
    _read_only(rec.store, False)
    assert not rec.store.op("recover-1").done
    assert rec.ops.watch() == [] and ran == ["recover-1"], "recorded, never run a second time"
    assert rec.store.op("recover-1").result == "succeeded"


def test_a_recovery_that_keeps_ending_is_taken_over_later_not_at_every_look(rec, monkeypatch):
    def dies(run: RecoveryRun) -> None:
        raise StoreUnavailable("full", action="free space")

    monkeypatch.setattr(RecoveryRun, "drive", dies)
    rec.s.watchdog_s = 30.0
    assert rec.ops.watch() == ["recover-1"]  # nothing drives it: adopted
    rec.ops.threads["recover-1"].join(30)
    assert rec.ops.watch() == []  # backing off
    rec.ops.runs["recover-1"].next_takeover = 0.0
    assert rec.ops.watch() == ["recover-1"]
    rec.ops.threads["recover-1"].join(30)


def test_a_recovery_of_a_job_nobody_knows_says_so_not_that_it_has_no_snapshot(rec):
    """Before: `pitstop recover trian` (a typo) answered "job trian has no complete snapshot"."""
    from pitstop.errors import NotFound, PitstopError

    class Snaps(_Snaps):
        held: set[str] = set()

        def committed(self, job: str) -> None:
            return None

    rec.snaps = Snaps()
    with pytest.raises(NotFound) as e:
        rec.start("trian")
    assert e.value.code == "no_such_job" and "no job named 'trian'" in e.value.message
    assert "pitstop jobs" in e.value.action
    rec.store.heartbeat({"name": "host-a", "url": "http://host-a:7070",
                         "workers": [{"id": "llama.0", "job": "llama", "rank": 0, "state": "running"}]})
    with pytest.raises(PitstopError) as e:  # a job it knows, without a snapshot: that is what it says
        rec.start("llama")
    assert e.value.code != "no_such_job" and "has no complete snapshot" in e.value.message


def test_while_the_database_cannot_be_read_a_recovery_is_not_taken_over_and_builds_no_back_off(rec, monkeypatch):
    """A recovery runs again from the record the store holds: taking it over while the store cannot
    be read would only end again, and each such end would push its next try further out."""
    def dies(run: RecoveryRun) -> None:
        raise StoreUnavailable("full", action="free space")

    monkeypatch.setattr(RecoveryRun, "drive", dies)
    rec.ops.spawn("recover-1", lambda r: r.run())
    rec.ops.threads["recover-1"].join(30)
    run = rec.ops.runs["recover-1"]

    def unreadable(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        raise StoreUnavailable("the coordinator cannot use its database: disk I/O error", action="check the disk")

    with monkeypatch.context() as m:
        m.setattr(rec.store, "ops", unreadable)
        m.setattr(rec.store, "op", unreadable)
        for _ in range(3):
            assert rec.ops.watch() == []
        assert run.takeovers == 0 and run.next_takeover == 0.0, "no back-off built while nothing could be read"
    assert rec.ops.watch() == ["recover-1"], "taken over at the first look once the store reads again"
    rec.ops.threads["recover-1"].join(30)

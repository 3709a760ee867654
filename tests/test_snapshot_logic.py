"""Unit tests of the snapshot and recovery decisions (the end-to-end runs are in test_recovery_e2e.py)."""

from __future__ import annotations

import time

import pytest

from pitstop.coordinator.recovery import is_recovery
from pitstop.coordinator.snapshots import buddies, interval
from pitstop.coordinator.sqlitestore import Store
from pitstop.errors import FailedPrecondition
from pitstop.launcher.run import bad_snapshot_every
from pitstop.wire.snapshot_record import SnapshotRecord
from pitstop.wire.store_rows import StoredHost, StoredOp, StoredWorker


def _host(name: str, role: str = "active", age: float = 0.0, domain: str | None = None) -> StoredHost:
    return StoredHost(name=name, url=f"http://{name}:7070", role=role, last_seen=time.time() - age, age_s=age,
                      failure_domain=domain)


def test_buddies_prefer_spares_then_the_next_host_and_never_the_host_itself():
    hosts = [_host("a"), _host("b"), _host("s1", "spare"), _host("s2", "spare")]
    assert buddies(["a", "b"], hosts, 5.0) == ({"a": "s1", "b": "s2"}, {"a": "a spare", "b": "a spare"})
    assert buddies(["a", "b"], [_host("a"), _host("b"), _host("c")], 5.0)[0] == {"a": "b", "b": "c"}
    assert buddies(["s1"], [_host("s1", "spare"), _host("a")], 5.0)[0] == {"s1": "a"}


def test_buddies_are_kept_outside_the_hosts_failure_domain_first():
    """A replica that fails with its host is no replica: another rack's spare, else another rack's
    host, before a spare in the same rack; the record says which rule chose."""
    hosts = [_host("a", domain="r1"), _host("b", domain="r2"), _host("s1", "spare", domain="r1"),
             _host("s2", "spare", domain="r2")]
    got, why = buddies(["a", "b"], hosts, 5.0)
    assert got == {"a": "s2", "b": "s1"}  # the plain rule would give a -> s1, in a's own rack
    assert why == {"a": "a spare outside failure domain r1", "b": "a spare outside failure domain r2"}
    # the only spare shares a's rack: another rack's active host keeps a's replica
    hosts = [_host("a", domain="r1"), _host("b", domain="r2"), _host("s1", "spare", domain="r1")]
    got, why = buddies(["a"], hosts, 5.0)
    assert got == {"a": "b"} and why["a"] == "a host outside failure domain r1 (no spare there)"
    # every other host in the same rack: a spare there still, and the record says so
    hosts = [_host("a", domain="r1"), _host("c", domain="r1"), _host("s1", "spare", domain="r1")]
    assert buddies(["a"], hosts, 5.0) == ({"a": "s1"}, {"a": "a spare (none outside failure domain r1)"})
    # a host in no known domain: the spare-then-next rule alone
    hosts = [_host("a"), _host("b", domain="r2"), _host("s1", "spare", domain="r1")]
    assert buddies(["a"], hosts, 5.0) == ({"a": "s1"}, {"a": "a spare"})


def test_a_buddy_is_kept_while_it_is_still_among_the_best():
    """The next part is a delta that only the last buddy can take: a host that comes back (host b,
    first by name) does not take host a's replica from the host that keeps it; a spare that joins
    does (a better rule): host a's parts in that snapshot are whole (test_recovery_e2e.py)."""
    hosts = [_host("a"), _host("b"), _host("c")]
    assert buddies(["a"], hosts, 5.0, previous={"a": "c"})[0] == {"a": "c"}
    assert buddies(["a"], hosts, 5.0)[0] == {"a": "b"}
    assert buddies(["a"], [*hosts, _host("s1", "spare")], 5.0, previous={"a": "c"})[0] == {"a": "s1"}
    assert buddies(["a"], [_host("a"), _host("b")], 5.0, previous={"a": "c"})[0] == {"a": "b"}  # c is gone


def test_silent_or_drained_hosts_keep_no_replica():
    hosts = [_host("a"), _host("b", age=60), _host("c", "drained"), _host("s1", "spare", age=60)]
    with pytest.raises(FailedPrecondition, match="no other healthy host"):
        buddies(["a"], hosts, 5.0)


def test_a_snapshot_begun_before_a_recovery_never_commits(tmp_path):
    """Dumped just before a partition, its replica complete only once the partition healed, after
    the recovery ended: its parts are of ranks the recovery replaced, so it never counts."""
    from pitstop.coordinator.settings import CoordinatorSettings
    from pitstop.coordinator.snapshots import Snapshots
    from pitstop.errors import Conflict

    s = Store(tmp_path / "c.db")
    snaps = Snapshots(s, CoordinatorSettings(insecure=True), busy=dict)
    s.put_snapshot("j", 1, "committed", SnapshotRecord())
    for n in (2, 3, 4):  # each recorded as it began
        s.put_snapshot("j", n, "taking", SnapshotRecord())
    snaps.commit("j", 2, SnapshotRecord(), generation=0)  # no recovery meanwhile: it counts
    snaps.hold("j")  # a recovery begins from snapshot 2 ...
    with pytest.raises(Conflict, match="recovery of the job began"):
        snaps.commit("j", 3, SnapshotRecord(), generation=0)
    snaps.release("j")  # ... and ends; snapshot 3, begun before it, completes only now
    with pytest.raises(Conflict, match="recovery of the job began"):
        snaps.commit("j", 3, SnapshotRecord(), generation=0)
    assert {x.number: x.state for x in s.snapshots("j")} == {1: "committed", 2: "committed", 3: "failed",
                                                                    4: "taking"}
    snaps.commit("j", 4, SnapshotRecord(), generation=1)  # one begun after the recovery counts
    s.put_snapshot("j", 5, "taking", SnapshotRecord())
    s.forget_snapshots("j", keep=None)  # the job's snapshots dropped (a failed recovery) while 5 was taken
    with pytest.raises(Conflict, match="were dropped"):
        snaps.commit("j", 5, SnapshotRecord(), generation=1)
    assert s.snapshots("j") == []  # nothing written back


def test_an_interval_whose_pauses_would_take_more_than_the_share_is_lengthened_and_says_why(tmp_path):
    """A snapshot every 5 s that pauses the job 3 s would stop it more than half its time: the
    interval becomes pause / share, said in `stretched`, and returns to the one asked once the
    pauses are short again.  The job's protection is judged against the interval it gets."""
    from pitstop.coordinator.settings import CoordinatorSettings
    from pitstop.coordinator.snapshots import Snapshots

    snaps = Snapshots(Store(tmp_path / "c.db"), CoordinatorSettings(insecure=True, snapshot_pause_share=0.05),
                      busy=dict)
    assert snaps.effective("j", 5.0) == 5.0  # no pause measured yet
    snaps.paused("j", 0.2)
    assert snaps.effective("j", 5.0) == 5.0 and "j" not in snaps.stretched  # 4 %: under the share
    snaps.paused("j", 3.0)
    assert snaps.effective("j", 5.0) == pytest.approx(60.0)
    assert "every 60 s, not the 5 s asked" in snaps.stretched["j"]
    assert "PITSTOP_COORDINATOR_SNAPSHOT_PAUSE_SHARE" in snaps.stretched["j"]
    assert snaps.paused_total["j"] == pytest.approx(3.2)
    snaps.paused("j", 0.1)
    assert snaps.effective("j", 5.0) == 5.0 and "j" not in snaps.stretched
    assert snaps.effective("j", None) is None  # a job that asked for no snapshots gets none


def _row(rank: int, every: float | None) -> StoredWorker:
    return StoredWorker(id=f"j.{rank}", job="j", rank=rank, host="a", state="running", updated=0.0,
                        snapshot_every_s=every)


def test_the_interval_is_the_apis_else_the_smallest_a_rank_asked(tmp_path):
    s = Store(tmp_path / "c.db")
    ws = [_row(r, every) for r, every in enumerate((60.0, 30.0, None))]
    assert interval(s, "j", ws) == 30.0
    assert interval(s, "j", [_row(0, None)]) is None
    s.set_snapshot_policy("j", 120.0)
    assert interval(s, "j", ws) == 120.0
    s.set_snapshot_policy("j", 0.0)  # off, whatever the launchers asked
    assert interval(s, "j", ws) is None
    s.set_snapshot_policy("j", None)
    assert interval(s, "j", ws) == 30.0


def test_snapshot_records_and_fences_in_the_store(tmp_path):
    s = Store(tmp_path / "c.db")
    s.put_snapshot("j", 1, "committed", SnapshotRecord())
    s.put_snapshot("j", 2, "taking", SnapshotRecord())
    s.put_snapshot("j", 2, "committed", SnapshotRecord(pause_s=0.5))
    assert [(x.number, x.state) for x in s.snapshots("j")] == [(1, "committed"), (2, "committed")]
    s.forget_snapshots("j", keep=2)
    assert [x.number for x in s.snapshots("j")] == [2] and s.snapshots("j")[0].record.pause_s == 0.5
    s.fence("j", "b", epoch=7)
    assert s.fences(host="b", unacked=True)[0].epoch == 7
    # a fenced host's reports of the job's workers are ignored until the fence is acknowledged
    s.heartbeat({"name": "b", "url": "http://b:1", "workers": [{"id": "j.1", "job": "j", "rank": 1, "state": "running"}]})
    assert s.workers(job="j") == []
    s.ack_fence("j", "b")  # acknowledged: a report the host built before its kill is still not believed
    s.heartbeat({"name": "b", "url": "http://b:1", "workers": [{"id": "j.1", "job": "j", "rank": 1, "state": "running"}]})
    assert s.workers(job="j") == []
    s.clear_fence("j", "b")  # a later recovery restores the job's ranks there
    s.heartbeat({"name": "b", "url": "http://b:1", "workers": [{"id": "j.1", "job": "j", "rank": 1, "state": "running"}]})
    assert [w.id for w in s.workers(job="j")] == ["j.1"]


def test_recovery_operations_are_told_from_evacuations():
    op = lambda t: StoredOp(id="op-1", node="a", metadata={"@type": t}, created=0.0, updated=0.0)  # noqa: E731
    assert is_recovery(op("type.pitstop.dev/RecoverMetadata"))
    assert not is_recovery(op("type.pitstop.dev/EvacuateMetadata"))


@pytest.mark.parametrize("every,ok", [(None, True), (5, True), (3600, True), (4.9, False), (1e9, False)])
def test_snapshot_every_is_checked_before_the_command_starts(every, ok):
    assert (bad_snapshot_every(every) is None) == ok


def _crash_world(tmp_path, ends: dict[str, list[tuple[str, float | None, dict]]], snapshot_at: float):
    """A store with job j's ranks on the given hosts, each (state, ended_at, extra), and a committed
    snapshot taken at `snapshot_at`; the Recoveries that reads it."""
    from pitstop.coordinator.recovery import Recoveries
    from pitstop.coordinator.settings import CoordinatorSettings
    from pitstop.coordinator.snapshots import Snapshots

    s = Store(tmp_path / "c.db")
    rank = 0
    for host, ranks in ends.items():
        ws = []
        for state, at, extra in ranks:
            ws.append({"id": f"j.{rank}", "job": "j", "rank": rank, "state": state, "root_pid": 100 + rank,
                       "ended_at": at, **extra})
            rank += 1
        s.heartbeat({"name": host, "url": f"http://{host}:7070", "spare": False, "workers": ws})
    s.put_snapshot("j", 1, "committed", SnapshotRecord())
    s._x("UPDATE snapshots SET created=?", (snapshot_at,))
    settings = CoordinatorSettings(insecure=True)
    return Recoveries(s, settings, Snapshots(s, settings, busy=dict), busy=dict)


def test_a_host_whose_ranks_all_failed_at_once_is_taken_for_lost(tmp_path):
    """A GPU fallen off the bus: host b's ranks fail together, a's a moment later (their collectives
    break); b is the one recovered, once every other host has reported since."""
    import itertools

    now = time.time()
    n = itertools.count()
    t0 = now - 10
    failed = {"exit_code": 1}

    def world(b, a, snapshot_at=now - 60):
        d = tmp_path / f"world{next(n)}"
        d.mkdir()
        return _crash_world(d, {"host-a": a, "host-b": b}, snapshot_at)

    r = world([("exited", t0, failed), ("lost", t0 + 0.3, {})], [("exited", t0 + 0.5, failed), ("exited", t0 + 0.6, failed)])
    host, why = r.crashed_host("j")
    assert host == "host-b" and "failed within 2 s" in why
    # a's ranks still run (it waits in a collective): b still
    assert world([("exited", t0, failed), ("exited", t0, failed)], [("running", None, {})] * 2).crashed_host("j")[0] == \
        "host-b"
    # not at once: ranks that ended minutes apart
    assert world([("exited", t0 - 200, failed), ("exited", t0, failed)], [("running", None, {})] * 2).crashed_host("j") \
        is None
    # the job finished (a rank exited 0), or its end was asked for (a forwarded SIGTERM, pitstop kill)
    assert world([("exited", t0, {"exit_code": 0}), ("exited", t0, failed)], [("exited", t0, failed)] * 2
                 ).crashed_host("j") is None
    assert world([("exited", t0, {**failed, "end_asked": True}), ("exited", t0, failed)], [("running", None, {})] * 2
                 ).crashed_host("j") is None
    # they failed before the snapshot: it holds them failed, nothing to roll back to
    assert world([("exited", t0, failed)] * 2, [("running", None, {})] * 2, snapshot_at=now).crashed_host("j") is None
    # just now, with host-a not heard since: it may be dying itself; wait for the next tick
    recent = time.time() - 0.2
    assert world([("exited", recent, failed)] * 2, [("running", None, {})] * 2).crashed_host("j") is None
    # a recovery of the job ended after they failed: it answered those ends (the rolled-back ranks on
    # host-a show as running only at its next report); seen once fencing host-a right after a recovery
    r = world([("running", None, {})] * 2, [("exited", t0, failed), ("exited", t0 + 0.2, failed)])
    assert r.crashed_host("j")[0] == "host-a"
    r.store.create_op("recover-1", "host-b", None, {"@type": "type.pitstop.dev/RecoverMetadata", "job": "j"}, None)
    r.store.update_op("recover-1", done=True, result="succeeded")
    assert r.crashed_host("j") is None


def test_a_host_whose_ranks_ended_first_and_then_went_silent_is_taken_for_lost(tmp_path):
    """The order hosts often die in: the kernel (or the OOM killer, or a crashing driver) kills
    host b's ranks first, its agent reports them ended, then the host goes silent; the ranks on
    host a fail a moment later on connection resets.  Before, neither rule saw it (failed_hosts
    looked only at live ranks on silent hosts, crashed_host only at hosts still heard from) and
    the job was lost.  b is the failed host; never a job that finished or was stopped."""
    import itertools

    now = time.time()
    t0 = now - 10
    n = itertools.count()
    failed = {"exit_code": 1}

    def world(b, a, snapshot_at=now - 60, b_silent=True):
        d = tmp_path / f"world{next(n)}"
        d.mkdir()
        r = _crash_world(d, {"host-a": a, "host-b": b}, snapshot_at)
        if b_silent:
            r.store.live.forget("host-b")  # nothing heard since, in memory either
            r.store._x("UPDATE hosts SET last_seen=? WHERE name=?", (now - 60, "host-b"))
        return r

    r = world([("exited", t0, {"exit_code": -9}), ("lost", t0, {})], [("exited", t0 + 0.5, failed)] * 2)
    assert r.failed_hosts("j") == ["host-b"]
    assert r._silent("j") == [("host-b", True)], "its ranks had ended before it went silent"
    assert world([("running", None, {})] * 2, [("running", None, {})] * 2)._silent("j") == [("host-b", False)]
    assert world([("exited", t0, failed)] * 2, [("exited", t0, failed)] * 2, b_silent=False).failed_hosts("j") == []
    # a job that finished (a rank exited 0) or was stopped is never recovered
    assert world([("exited", t0, {"exit_code": 0})] * 2, [("exited", t0, {"exit_code": 0})] * 2).failed_hosts("j") == []
    assert world([("exited", t0, {**failed, "end_asked": True})] * 2, [("exited", t0, failed)] * 2).failed_hosts("j") == []
    # ended before the snapshot: the snapshot holds them ended, nothing to roll back to
    assert world([("exited", t0, failed)] * 2, [("running", None, {})] * 2, snapshot_at=now).failed_hosts("j") == []


def test_a_snapshot_that_fails_after_the_jobs_snapshots_were_dropped_writes_no_record_back(tmp_path, monkeypatch):
    """A fresh-clone run, 2026-12-07: host b and its replicas' buddy died; the recovery failed (unrecoverable) and
    dropped the job's snapshots; a snapshot begun just before then failed on b's silence and wrote
    its record back, 'failed', saying the previous one still counted (there was none left)."""
    from pitstop.coordinator.settings import CoordinatorSettings
    from pitstop.coordinator.snapshots import Snapshots
    from pitstop.errors import PitstopError

    s = Store(tmp_path / "c.db")
    for h in ("a", "b", "c"):
        s.heartbeat({"name": h, "url": f"http://{h}:1", "spare": h == "c",
                     "workers": [{"id": "j.0", "job": "j", "rank": 0, "state": "running", "world": 2}] if h == "a" else
                     [{"id": "j.1", "job": "j", "rank": 1, "state": "running", "world": 2}] if h == "b" else []})
    snaps = Snapshots(s, CoordinatorSettings(insecure=True), busy=dict)
    s.put_snapshot("j", 1, "committed", SnapshotRecord())

    class Silent:
        def __init__(self, *a, **k):  # noqa: ANN002, ANN003
            pass

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):  # noqa: ANN002
            pass

        def snapshot_drop(self, job, **k):  # noqa: ANN001, ANN003
            pass

        def __getattr__(self, name):
            def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
                snaps.drop_everywhere("j", "its recovery failed")  # meanwhile, on the recovery's thread
                raise PitstopError("GET http://b:1/v1/workers:batchGetShim timed out")
            return call

    monkeypatch.setattr(snaps, "agent", lambda host, timeout=None: Silent())
    with pytest.raises(PitstopError, match="timed out"):
        snaps.take("j")
    assert s.snapshots("j") == [], "no record written back after the drop"
    # a failure with the records still there is recorded as before
    s.put_snapshot("j", 1, "committed", SnapshotRecord())
    monkeypatch.setattr(Silent, "__getattr__", lambda self, name: (_ for _ in ()).throw(PitstopError("refused")))
    with pytest.raises(PitstopError, match="refused"):
        snaps.take("j")
    assert [(x.number, x.state) for x in s.snapshots("j")] == [(1, "committed"), (2, "failed")]

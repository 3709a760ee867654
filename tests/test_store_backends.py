"""The coordinator's store on both of its databases, SQLite and a real PostgreSQL (tests/postgres.py):
the same records read back the same way through one schema and one list of migrations, the lease
with a term that only grows, writes fenced by that term, and a PostgreSQL restarted under a store
that then reconnects by itself."""

from __future__ import annotations

import threading
import time

import pytest

from pitstop.coordinator.database import describe, open_store, parse, shared
from pitstop.coordinator.schema import MIGRATIONS
from pitstop.coordinator.store import NotLeader, StoreUnavailable
from pitstop.wire.snapshot_record import SnapshotRecord

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):  # noqa: ANN001, ANN201
    if request.param == "sqlite":
        return f"sqlite://{tmp_path}/c.db"
    return request.getfixturevalue("pg_url")


@pytest.fixture
def store(url):  # noqa: ANN001, ANN201
    s = open_store(url)
    yield s
    s.close()


def _report(name: str, workers: list[dict] | None = None, spare: bool = False, generation: str = "g-1") -> dict:
    return {"name": name, "url": f"http://{name}:7070", "spare": spare, "generation": generation,
            "gpus": [{"index": 0}], "workers": workers or []}


def _w(job: str, rank: int, state: str = "running", **kw: object) -> dict:
    return {"id": f"{job}.{rank}", "job": job, "rank": rank, "state": state, **kw}


def test_urls_name_the_database():
    assert parse("/var/lib/pitstop/c.db") == ("sqlite", "/var/lib/pitstop/c.db")
    assert parse("sqlite:///var/lib/pitstop/c.db") == ("sqlite", "/var/lib/pitstop/c.db")
    assert parse("postgresql://u:secret@db:5432/pitstop") == ("postgresql", "postgresql://u:secret@db:5432/pitstop")
    assert shared("postgres://db/p") and not shared("c.db")
    assert describe("postgresql://u:secret@db:5432/pitstop") == "postgresql://u@db:5432/pitstop"
    for bad in ("mysql://db/p", "sqlite://relative.db", ""):
        with pytest.raises(ValueError):
            parse(bad)


def test_hosts_workers_and_beats_read_back_the_same(store, url):
    store.heartbeat(_report("gpu-1", [_w("j", 0, net={"address": "10.0.0.5/24"}, world=2)]))
    store.heartbeat(_report("spare-1", spare=True))
    hosts = {h.name: h for h in store.hosts()}
    assert hosts["gpu-1"].role == "active" and hosts["spare-1"].role == "spare"
    assert hosts["gpu-1"].gpus == [{"index": 0}] and hosts["gpu-1"].age_s < 5
    assert store.workers(host="gpu-1")[0].public() | {"updated": 0} == {
        "id": "j.0", "job": "j", "rank": 0, "host": "gpu-1", "state": "running", "updated": 0,
        "address": "10.0.0.5/24", "caps": None, "unmovable": None, "slurm_job": None, "snapshot_every_s": None,
        "world": 2, "exit_code": None, "ended_at": None, "end_asked": None, "peer_lost": None}
    # a beat of the generation last reported is answered from memory, and written by the next flush
    before = store.host("gpu-1").last_seen
    time.sleep(0.05)
    assert store.beat("gpu-1", "g-1") and not store.beat("gpu-1", "g-0") and not store.beat("nobody", "g-1")
    store.set_health("gpu-1", [{"index": 0, "temperature_c": 99}], {"degraded": True, "reasons": ["hot"]})
    assert store.flush() == 1
    again = open_store(url)  # a restarted coordinator
    try:
        h = again.host("gpu-1")
        assert h.last_seen > before and h.health == {"degraded": True, "reasons": ["hot"]}
        # beats taken at once after a restart: the generations held are read back
        assert again.beat("gpu-1", "g-1") and again.beat("spare-1", "g-1") and not again.beat("gpu-1", "g-0")
    finally:
        again.close()


def test_a_hosts_report_from_a_newer_agent_keeps_what_this_release_does_not_know(store):
    """A host's row is typed, but a field a newer agent reports is kept and shown, not dropped;
    and the report read back (Store.sync_workers rewrites it with fresher workers) is the one sent."""
    store.heartbeat({**_report("s", spare=True), "gpu_model": "H100", "gpu_count": 8, "nvlink_domains": [0, 1]})
    h = store.host("s")
    assert (h.offers_spare, h.gpu_model, h.gpu_count, h.role) == (True, "H100", 8, "spare")
    assert h.public()["nvlink_domains"] == [0, 1]
    assert h.report() == {"name": "s", "url": "http://s:7070", "spare": True, "gpus": [{"index": 0}],
                          "gpu_model": "H100", "gpu_count": 8, "nvlink_domains": [0, 1]}
    store.sync_workers("s", [_w("j", 0)])
    again = store.host("s")  # read once: its age_s moves with the clock
    assert again is not None and again.public() == h.public() | {"age_s": again.age_s}
    assert [w.host for w in store.workers(job="j")] == ["s"]


def test_roles_cordons_claims_and_removal(store):
    store.heartbeat(_report("a"))
    store.heartbeat(_report("b"))
    store.set_role("a", "draining", {"reason": "maintenance"})
    store.set_role("a", "drained")
    h = store.host("a")
    assert h.role == "drained" and h.role_why == {"reason": "maintenance"} and h.role_since
    store.set_cordon("b", {"reason": "flaky", "by": "op"})
    assert store.host("b").cordoned == {"reason": "flaky", "by": "op"}
    assert store.claim_worker("a", "j.0", "j", 0, 5.0, owner_uid=1000) is None
    assert store.claim_worker("b", "j.0", "j", 0, 5.0, owner_uid=1000) == "a"  # a's fresh claim holds
    store.heartbeat(_report("a", [_w("j", 0)]))
    assert store.claim_worker("b", "j.0", "j", 0, 5.0, owner_uid=1000) == "a"  # a runs it and is heard from
    assert store.claim_worker("b", "j.0", "j", 0, 0.0, owner_uid=1000) is None  # ... until a is silent
    got = store.claim_worker("b", "j.1", "j", 1, 5.0, owner_uid=1001)
    assert got is not None and not isinstance(got, str) and got.uid == 1000  # another user's job
    store.set_worker_host("j.0", "b", "running")
    assert store.workers(job="j")[0].host == "b"
    store.remove_host("a")
    assert store.host("a") is None and [h.name for h in store.hosts()] == ["b"]


def test_a_report_of_the_copy_a_move_left_arriving_after_the_commit_keeps_the_worker_where_it_went(store):
    """An agent's report written while its rank was being captured, handled after the move had
    committed, took the rank back to the host it had left until the new host's next beat.  Only
    that very copy, as the move names it, is old news: a new process of the same rank on that host
    (moved back, or a job started again) is not.  The destination's report of the restored copy may
    come before the commit."""
    store.heartbeat(_report("a", [_w("j", 0, root_pid=100, start_time=7)]))
    store.heartbeat(_report("b", [_w("j", 0, state="paused", root_pid=200, start_time=9)]))  # restored, before
    store.set_worker_host("j.0", "b", "running", left={"host": "a", "pid": 100, "start_time": 7})  # committed
    store.heartbeat(_report("a", [_w("j", 0, state="stopped", root_pid=100, start_time=7)]))  # written before
    assert store.workers(job="j")[0].host == "b"
    store.heartbeat(_report("a", [_w("j", 0, state="running", root_pid=100, start_time=8)]))  # pid reused: new
    assert store.workers(job="j")[0].host == "a"
    store.set_worker_host("j.0", "b", "running", left={"host": "a", "pid": 100, "start_time": 8})
    store.set_worker_host("j.0", "a", "running", left={"host": "b", "pid": 200, "start_time": 9})  # moved back
    store.heartbeat(_report("a", [_w("j", 0, root_pid=300, start_time=11)]))
    store.heartbeat(_report("b", [_w("j", 0, state="capturing", root_pid=200, start_time=9)]))  # b's late report
    assert store.workers(job="j")[0].host == "a"
    store.heartbeat(_report("b", [_w("j", 0, root_pid=400, start_time=12)]))  # another process: b runs it now
    assert store.workers(job="j")[0].host == "b"


def test_a_copy_restored_elsewhere_runs_there_only_once_its_operation_records_it(store):
    """A spare's report of the copy it restored, written before the move rolled back (and the
    copy was discarded) and read after, took the rank from the host that ran it again; that
    host's next reports were beats, and its rank's end is no news from a host that does not hold
    it, so the job's ranks stayed listed on the spare for good.  The commit (or a recovery's
    resume) says where a restored copy runs."""
    store.heartbeat(_report("b", [_w("j", 3, root_pid=100, start_time=7)]))
    store.heartbeat(_report("spare", [_w("j", 3, state="paused", restored=True, root_pid=200, start_time=9)]))
    assert store.workers(job="j")[0].host == "b"  # restored, not committed: still b's
    store.heartbeat(_report("b", [_w("j", 3, state="exited", root_pid=100, start_time=7)]))
    assert [(w.host, w.state) for w in store.workers(job="j")] == [("b", "exited")]
    store.heartbeat(_report("b", [_w("j", 3, root_pid=101, start_time=8)]))
    store.set_worker_host("j.3", "spare", "running", left={"host": "b", "pid": 101, "start_time": 8})  # committed
    store.heartbeat(_report("spare", [_w("j", 3, restored=True, root_pid=200, start_time=9)]))
    assert [(w.host, w.state) for w in store.workers(job="j")] == [("spare", "running")]


def test_snapshots_policies_and_fences(store):
    store.set_snapshot_policy("j", 30.0)
    assert store.snapshot_policy("j") == 30.0
    store.set_snapshot_policy("j", None)
    assert store.snapshot_policy("j") is None
    store.put_snapshot("j", 1, "taking", SnapshotRecord(buddies={"a": "b"}))
    store.put_snapshot("j", 1, "committed", SnapshotRecord(buddies={"a": "b"}, bytes=5))
    store.put_snapshot("j", 2, "failed", SnapshotRecord(error="a host went silent"))
    assert [(s.number, s.state) for s in store.snapshots("j")] == [(1, "committed"), (2, "failed")]
    first = store.snapshots("j")[0]
    assert first.record.bytes == 5 and first.record.buddies == {"a": "b"} and store.snapshot_jobs() == ["j"]
    assert first.public() == {"job": "j", "number": 1, "state": "committed", "created": first.created,
                              "schema_version": 1, "buddies": {"a": "b"}, "bytes": 5}
    store.forget_snapshots("j", keep=1)
    assert [s.number for s in store.snapshots("j")] == [1]
    epoch = int(time.time() * 1000)  # milliseconds: past 32 bits
    store.fence("j", "a", epoch)
    assert store.fences(host="a", unacked=True)[0].epoch == epoch
    store.heartbeat(_report("a", [_w("j", 0)]))
    assert store.workers(job="j") == []  # a fenced host's reports of the job are ignored
    store.ack_fence("j", "a")
    assert store.fences(unacked=True) == [] and store.fences()[0].acked is True
    store.clear_fence("j", "a")
    assert store.fences() == []


def test_operations_pages_idempotency_and_pruning(store):
    for i in range(5):
        store.create_op(f"op-{i}", "a", "b", {"i": i}, (f"key-{i}", f"hash-{i}") if i == 0 else None)
        time.sleep(0.01)
    assert store.idempotent("key-0") == ("hash-0", "op-0") and store.idempotent("nope") is None
    store.update_op("op-1", phase="capture", metadata={"i": 1, "x": True}, error={"code": 13}, dest="c")
    store.update_op("op-2", done=True, result="succeeded", response={"ok": 1})
    store.request_cancel("op-3")
    op1, op2 = store.op("op-1"), store.op("op-2")
    assert (op1.phase, op1.metadata, op1.error, op1.dest, op1.done) == \
        ("capture", {"i": 1, "x": True}, {"code": 13}, "c", False)
    assert op2.done and op2.result == "succeeded" and op2.response == {"ok": 1}
    assert store.op("op-3").cancel_requested and store.op("nope") is None
    assert [o.id for o in store.ops()] == [f"op-{i}" for i in range(5)]
    assert [o.id for o in store.ops(running_only=True)] == ["op-0", "op-1", "op-3", "op-4"]
    assert [o.id for o in store.ops(done=True)] == ["op-2"]
    page = store.ops(limit=2)
    assert [o.id for o in page] == ["op-3", "op-4"]
    assert [o.id for o in store.ops(limit=2, before=page[0].created)] == ["op-1", "op-2"]
    assert [o.id for o in store.ops(node="c")] == ["op-1"]
    assert store.prune_ops(older_than_s=0) == 1 and store.op("op-2") is None


def test_a_fresh_database_is_at_the_last_schema_version_and_opens_again(url):
    s = open_store(url)
    try:
        assert s._schema_version() == len(MIGRATIONS)
        assert {"generation", "cordon", "role_since", "role_why"} <= s.columns("hosts")
        assert s.lease()["term"] == 0
    finally:
        s.close()
    again = open_store(url)  # nothing left to do
    try:
        assert again._schema_version() == len(MIGRATIONS)
    finally:
        again.close()


def test_the_lease_has_one_holder_and_a_term_that_only_grows(url):
    a, b = open_store(url), open_store(url)
    try:
        got = a.acquire_lease("a", "http://a:7000", ttl_s=1.0)
        assert got is not None and got["term"] == 1 and got["expires"] > got["since"]
        assert b.acquire_lease("b", "http://b:7000", ttl_s=1.0) is None  # held, not expired
        assert a.renew_lease("a", 1, ttl_s=1.0) is not None
        assert b.lease()["holder"] == "a" and b.lease()["url"] == "http://a:7000"
        time.sleep(1.2)  # a stops renewing: the lease expires in the database's clock
        got_b = b.acquire_lease("b", "http://b:7000", ttl_s=5.0)
        assert got_b is not None and got_b["term"] == 2
        assert a.renew_lease("a", 1, ttl_s=1.0) is None  # a's term is over
        assert b.release_lease("b", 2) and b.lease()["expires"] == 0  # a coordinator that stops gives it up
        got_a = a.acquire_lease("a", "http://a:7000", ttl_s=5.0)
        assert got_a is not None and got_a["term"] == 3
        # an agent saw a higher term than the database holds (a database restored from a backup)
        assert a.raise_term("a", 3, above=41) == 42 and a.lease()["term"] == 42
        assert b.raise_term("b", 42, above=50) is None  # only the holder may
        # the same coordinator started again takes its own lease at once, with the next term
        got_a2 = a.acquire_lease("a", "http://a:7000", ttl_s=5.0)
        assert got_a2 is not None and got_a2["term"] == 43
    finally:
        a.close()
        b.close()


def test_coordinators_racing_for_the_lease_elect_one(url):
    stores = [open_store(url) for _ in range(4)]
    got: dict[int, dict | None] = {}
    go = threading.Barrier(len(stores))

    def race(i: int) -> None:
        go.wait()
        got[i] = stores[i].acquire_lease(f"c{i}", f"http://c{i}:7000", ttl_s=10.0)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(len(stores))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        winners = [i for i, g in got.items() if g is not None]
        assert len(got) == len(stores) and len(winners) == 1, got
        assert got[winners[0]]["term"] == 1 and stores[0].lease()["holder"] == f"c{winners[0]}"
    finally:
        for s in stores:
            s.close()


def test_writes_are_fenced_by_the_term(url):
    leader, old = open_store(url), open_store(url)
    try:
        t1 = old.acquire_lease("old", "http://old:7000", ttl_s=0.2)["term"]
        old.fenced, old.fence_term = True, t1
        old.heartbeat(_report("a"))  # the leader writes
        time.sleep(0.3)
        t2 = leader.acquire_lease("new", "http://new:7000", ttl_s=10.0)["term"]
        leader.fenced, leader.fence_term = True, t2
        with pytest.raises(NotLeader, match=f"term {t1} is over"):
            old.create_op("op-1", "a", None, {}, None)
        with pytest.raises(NotLeader):
            old.update_op("op-x", phase="x")  # a lone statement too
        assert leader.op("op-1") is None
        leader.create_op("op-2", "a", None, {}, None)
        standby = open_store(url)
        standby.fenced = True  # a standby (no term) reads, and writes nothing
        try:
            assert standby.op("op-2") is not None
            with pytest.raises(NotLeader, match="standby"):
                standby.set_cordon("a", {"reason": "x"})
            assert isinstance(NotLeader("x"), StoreUnavailable)  # every write path copes with it
        finally:
            standby.close()
    finally:
        leader.close()
        old.close()


def test_coordinators_started_at_once_on_a_new_database_migrate_it_once(pg_url):
    out: list = []

    def start() -> None:
        try:
            out.append(open_store(pg_url))
        except Exception as e:  # noqa: BLE001 - collected and shown
            out.append(e)

    threads = [threading.Thread(target=start) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert len(out) == 4 and not [e for e in out if isinstance(e, Exception)], out
        assert out[0]._schema_version() == len(MIGRATIONS)
    finally:
        for s in out:
            if not isinstance(s, Exception):
                s.close()


def test_a_postgresql_restarted_under_the_store_is_unavailable_then_reconnected(postgres, pg_url):
    s = open_store(pg_url)
    try:
        s.heartbeat(_report("a"))
        postgres.stop()
        try:
            with pytest.raises(StoreUnavailable) as e:
                s.create_op("op-1", "a", None, {}, None)
            assert e.value.code == "database_unavailable" and "PostgreSQL server" in e.value.action
            assert "secret" not in e.value.message and e.value.details["database"] == describe(pg_url)
            with pytest.raises(StoreUnavailable):
                s.hosts()
        finally:
            postgres.start()
        s.create_op("op-1", "a", None, {}, None)  # a new connection, made by the call itself
        assert s.op("op-1") is not None and [h.name for h in s.hosts()] == ["a"]
    finally:
        s.close()


def test_a_closed_sqlite_store_answers_unavailable_never_crashes(tmp_path):
    """A thread of an operation still saving as its coordinator closes the store (in-process tests,
    a coordinator stopping): the close waits for the statement under way, and later ones get
    StoreUnavailable.  Closing under a running statement crashed the process (sqlite3)."""
    from pitstop.coordinator.sqlitestore import Store
    from pitstop.coordinator.store import StoreUnavailable

    s = Store(tmp_path / "c.db")
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            try:
                s.ops(running_only=True)
            except StoreUnavailable:
                return
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    ts = [threading.Thread(target=writer) for _ in range(4)]
    for t in ts:
        t.start()
    s.close()
    stop.set()
    for t in ts:
        t.join(10)
    assert not errors, errors
    with pytest.raises(StoreUnavailable, match="is closed"):
        s.ops()

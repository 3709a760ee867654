"""The coordinator's database failing under it (a full or read-only file system): the store says
so as an error with what to do (503 in the API), and an evacuation it can no longer record is
still undone on the agents, its record written once the database takes writes again.  Logic
tests, in process, with agents faked; the real thing (a full tmpfs under a live evacuation) is
tests/test_store_failure_e2e.py."""

from __future__ import annotations

import sqlite3
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from pitstop.coordinator import operations
from pitstop.coordinator.api import build
from pitstop.coordinator.driver import Driver
from pitstop.coordinator.evacuation_run import OpRun
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.sqlitestore import Store
from pitstop.coordinator.store import StoreUnavailable
from pitstop.errors import NotFound, PitstopError
from pitstop.wire.capture_report import CaptureReport
from pitstop.wire.evacuation import EvacuationState

from .helpers import plan_of

pytestmark = pytest.mark.timeout(60)
CLUSTER, OPERATOR = "cluster-token", "op-token"


def _report(name: str, workers: int = 1) -> dict:
    return {"name": name, "url": f"http://{name}:7070", "spare": False,
            "workers": [{"id": f"j.{i}", "job": "j", "rank": i, "state": "running"} for i in range(workers)]}


def _full(store: Store) -> None:
    """SQLite's own "database or disk is full" (SQLITE_FULL), as on a full file system: the
    database may not grow by a page."""
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count={pages}")


def _room(store: Store) -> None:
    store.db.execute("PRAGMA max_page_count=1073741823")


def _read_only(store: Store, on: bool) -> None:
    """Every write refused (SQLITE_READONLY), as on a file system remounted read-only."""
    store.db.execute(f"PRAGMA query_only={int(on)}")


# -- the store ---------------------------------------------------------------------------------

def test_a_full_database_says_so_and_what_to_do_not_that_no_transaction_is_active(tmp_path):
    """SQLite rolls back a transaction that hit a full disk by itself; the store's ROLLBACK after
    that failed with "cannot rollback - no transaction is active", and that was all anyone saw."""
    s = Store(tmp_path / "c.db")
    s.heartbeat(_report("gpu-1"))
    _full(s)
    with pytest.raises(StoreUnavailable) as e:
        s.heartbeat(_report("gpu-2", workers=200))  # a new host and its workers: new pages
    err = e.value
    assert "database or disk is full" in err.message and str(tmp_path / "c.db") in err.message, err.message
    assert err.http_status == 503 and err.code == "database_unavailable"
    assert "free space" in err.action and err.details["sqlite_error"] == "SQLITE_FULL", err.to_dict()
    assert isinstance(err.__cause__, sqlite3.OperationalError)
    assert not s.db.in_transaction
    with pytest.raises(StoreUnavailable):
        s.create_op("op-1", "gpu-1", "gpu-2", {"pad": "x" * 50_000}, ("key", "hash"))
    assert s.ops() == [] and s.idempotent("key") is None  # nothing half written
    _room(s)  # space again: the same store, no restart
    s.heartbeat(_report("gpu-2", workers=200))
    s.create_op("op-1", "gpu-1", "gpu-2", {"pad": "x" * 50_000}, ("key", "hash"))
    assert len(s.workers(host="gpu-2")) == 200 and s.idempotent("key") == ("hash", "op-1")


def test_a_transaction_left_open_is_rolled_back_before_the_next_one(tmp_path):
    s = Store(tmp_path / "c.db")
    s.db.execute("BEGIN")  # as a ROLLBACK that itself failed would leave it
    s.db.execute("INSERT INTO hosts(name,url,role,info,last_seen) VALUES('ghost','u','active','{}',0)")
    s.heartbeat(_report("gpu-1"))
    assert [h.name for h in Store(tmp_path / "c.db").hosts()] == ["gpu-1"]


def test_a_mistake_in_sql_stays_a_mistake(tmp_path):
    """Only what the file system does becomes 503; a bug must not pass for a full disk."""
    s = Store(tmp_path / "c.db")
    with pytest.raises(sqlite3.OperationalError):
        s._x("SELECT nope FROM hosts")


def test_the_api_answers_503_with_what_to_do_while_the_database_cannot_write(tmp_path):
    store = Store(tmp_path / "c.db")
    app, _ = build(CoordinatorSettings(db=tmp_path / "c.db", operator_token=OPERATOR, cluster_token=CLUSTER),
                   store=store)
    store.create_op("op-1", "gpu-1", "gpu-2", {}, None)
    agent, operator = {"Authorization": f"Bearer {CLUSTER}"}, {"Authorization": f"Bearer {OPERATOR}"}
    with TestClient(app, raise_server_exceptions=False) as c:
        _full(store)
        r = c.post("/v1/agents:heartbeat", json=_report("gpu-9", workers=200), headers=agent)
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", (r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] == "database_unavailable" and "database or disk is full" in err["message"], err
        assert "free space" in err["action"] and "send this request again" in err["action"], err
        _read_only(store, True)
        r = c.post("/v1/operations/op-1:cancel", headers=operator)
        assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable", r.text
        assert c.get("/v1/operations/op-1", headers=operator).status_code == 200  # reads still answer
        _read_only(store, False)
        _room(store)
        assert c.post("/v1/agents:heartbeat", json=_report("gpu-9", workers=200), headers=agent).status_code == 200
        assert c.post("/v1/operations/op-1:cancel", headers=operator).status_code == 200


# -- the driver --------------------------------------------------------------------------------

class FakeAgent:
    """What a rollback asks of an agent, answered as a healthy one would; every call noted."""

    def __init__(self, url: str, calls: list) -> None:
        self.url, self.calls = url, calls

    def _note(self, *call):  # noqa: ANN002, ANN202
        self.calls.append((self.url.split("//")[1].split(":")[0], *call))

    def precopies(self, timeout=None):  # noqa: ANN001, ANN201
        return []

    def stop_precopy(self, image_id):  # noqa: ANN001, ANN201
        raise NotFound("no pre-copy")

    def worker(self, wid):  # noqa: ANN001, ANN201
        raise NotFound(f"no worker {wid}")

    def discard(self, image_id):  # noqa: ANN001, ANN201
        self._note("discard", image_id)

    def captures(self):  # noqa: ANN201
        return []

    def get_capture(self, cid):  # noqa: ANN001, ANN201
        return CaptureReport(id=cid, worker_id="train.1", state="dumped")

    def rollback(self, cid):  # noqa: ANN001, ANN201
        self._note("rollback", cid)

    def resume_many(self, wids):  # noqa: ANN001, ANN201
        self._note("resume", sorted(wids))
        return []

    def close(self) -> None:
        pass


@pytest.fixture
def world(tmp_path, monkeypatch):
    """A store and driver with one evacuation (train.1 from host-b to spare-1) caught in its
    capture: train.0 on host-a paused, train.1's capture under way.  Agents are fakes."""
    calls: list = []
    monkeypatch.setattr(operations, "AgentClient", lambda url, token=None, timeout=None, fence=None: FakeAgent(url, calls))
    store = Store(tmp_path / "c.db")
    for name in ("host-a", "host-b", "spare-1"):
        store.heartbeat(_report(name, workers=0))
    plan = plan_of("host-b", "spare-1", {"train.1": (1, "host-b")}, peers={"train.0": (0, "host-a")})
    state = EvacuationState.new(plan, "test")
    state.phase, state.paused, state.capture_begun = "capture", ["train.0"], True
    state.workers["train.1"].capture_id, state.workers["train.1"].state = "cap-1", "capturing"
    md = state.dump()
    store.create_op("op-1", "host-b", "spare-1", md, None)
    store.update_op("op-1", phase="capture", metadata=md)
    d = Driver(store, CoordinatorSettings(db=tmp_path / "c.db", watchdog_s=0.05))
    return SimpleNamespace(store=store, driver=d, calls=calls)


def _undone(calls: list) -> None:
    assert ("host-b", "rollback", "cap-1") in calls, calls
    assert ("host-a", "resume", ["train.0"]) in calls, calls
    assert ("spare-1", "discard", "op-1-train_1") in calls, calls


def _drive(d: Driver, op_id: str, fn) -> None:  # noqa: ANN001
    d.ops.spawn(op_id, fn)
    d.ops.threads[op_id].join(30)
    assert not d.ops.threads[op_id].is_alive()


def test_a_rollback_undoes_on_the_agents_though_the_database_refuses_every_write(world):
    """The finding: the rollback's first write raised, its thread died, and the paused peer
    stayed SIGSTOPped with the spare busy until a restart of the coordinator."""
    s, d = world.store, world.driver
    _read_only(s, True)
    _drive(d, "op-1", lambda r: r.rollback(StoreUnavailable("the coordinator cannot use its database: full",
                                                            action="free space")))
    _undone(world.calls)
    assert not s.op("op-1").done, "recorded while the database refused writes?"
    assert d.ops.watch() == [] and not s.op("op-1").done  # its record waits; the undo is not done again
    assert len([c for c in world.calls if c[1] == "resume"]) == 1
    _read_only(s, False)  # the database takes writes again: the watchdog writes the record
    assert d.ops.watch() == [] and "op-1" not in d.ops.runs
    op = s.op("op-1")
    assert op.done and op.result == "failed" and op.phase == "done", op
    meta = op.error["details"][0]["metadata"]
    assert op.error["status"] == "UNAVAILABLE" and "free space" in op.error["details"][0]["action"]
    assert meta["rollback_problems"] == [] and "readonly" in meta["database_error"], meta
    assert {c["type"]: c["status"] for c in op.metadata["conditions"]}["RolledBack"] == "True"
    assert op.metadata["workers"]["train.1"]["state"] == "rolled_back"


def test_a_phase_that_cannot_be_recorded_is_not_started_and_the_move_rolls_back(world):
    """Before the commit point the record comes first: a restart would roll back whatever it
    does not hold, so a phase the database refuses is not begun."""
    s, d = world.store, world.driver
    run = OpRun(d, "op-1")
    _read_only(s, True)
    with pytest.raises(StoreUnavailable):
        run._pass_commit_point()
    assert not run.md.committed and not run.best_effort
    _read_only(s, False)
    assert not s.op("op-1").metadata["committed"]


def test_the_watchdog_rolls_back_an_operation_whose_driver_died(world):
    s, d = world.store, world.driver

    def dies(run: OpRun) -> None:
        raise RuntimeError("boom")  # an error nobody expected, past run()'s own handling

    _drive(d, "op-1", dies)
    assert world.calls == [] and not s.op("op-1").done  # the driver is gone; the peer is still paused
    assert d.ops.watch() == ["op-1"]
    d.ops.threads["op-1"].join(30)
    _undone(world.calls)
    op = s.op("op-1")
    assert op.done and op.result == "failed", op
    assert op.error["details"][0]["reason"] == "driver_stopped" and "RuntimeError: boom" in op.error["message"]
    assert d.ops.watch() == [] and not d.ops.runs


def test_the_watchdog_adopts_an_operation_nothing_drives(world):
    """Its record says it runs and no thread of this coordinator drives it (a start that failed
    between writing the operation and starting its thread)."""
    s, d = world.store, world.driver
    assert d.ops.watch() == ["op-1"]
    d.ops.threads["op-1"].join(30)
    _undone(world.calls)
    assert s.op("op-1").result == "failed" and "no driver" in s.op("op-1").error["message"]


def test_a_driver_that_keeps_dying_is_taken_over_again_later_not_at_every_look(world, monkeypatch):
    d = world.driver
    d.s.watchdog_s = 30.0  # the second takeover no sooner than 60 s after the first
    monkeypatch.setattr(OpRun, "rollback", lambda self, err: (_ for _ in ()).throw(PitstopError("still broken")))
    _drive(d, "op-1", lambda r: r.rollback(PitstopError("x")))
    assert d.ops.watch() == ["op-1"]
    d.ops.threads["op-1"].join(30)
    assert d.ops.watch() == []  # backing off: the next try after watchdog_s * 2 ** takeovers
    run = d.ops.runs["op-1"]
    run.next_takeover = 0.0
    assert d.ops.watch() == ["op-1"] and run.takeovers == 2
    d.ops.threads["op-1"].join(30)


def test_a_takeover_reaches_the_agents_though_the_database_cannot_even_be_read(world, monkeypatch):
    """An I/O error rather than a full disk: the agents' addresses cannot be read from the store,
    so the takeover uses those the operation already reached them at."""
    s, d = world.store, world.driver

    def dies(run: OpRun) -> None:
        for host in ("host-a", "host-b", "spare-1"):
            run.agent(host)
        raise RuntimeError("boom")

    _drive(d, "op-1", dies)

    broken, readable = [True], s.host

    def host(name: str) -> dict | None:
        if broken[0]:
            raise StoreUnavailable("the coordinator cannot use its database: disk I/O error", action="repair it")
        return readable(name)

    monkeypatch.setattr(s, "host", host)
    _read_only(s, True)
    assert d.ops.watch() == ["op-1"]
    d.ops.threads["op-1"].join(30)
    _undone(world.calls)
    assert not s.op("op-1").done
    broken[0] = False  # readable and writable again
    _read_only(s, False)
    d.ops.watch()
    assert s.op("op-1").result == "failed" and "RuntimeError: boom" in s.op("op-1").error["message"]


def test_a_database_of_an_earlier_release_is_migrated_in_order_and_a_newer_one_refused(tmp_path):
    """Schema changes go through ordered migrations (PRAGMA user_version): a database written before
    heartbeats had generations, at version 0, reaches the current version with its rows kept."""
    import sqlite3

    from pitstop.coordinator.schema import MIGRATIONS
    from pitstop.coordinator.sqlitestore import Store
    from pitstop.errors import FailedPrecondition

    old = tmp_path / "old.db"
    db = sqlite3.connect(old)
    db.executescript("""
CREATE TABLE hosts (name TEXT PRIMARY KEY, url TEXT NOT NULL, role TEXT NOT NULL, info TEXT NOT NULL,
  last_seen REAL NOT NULL);
CREATE TABLE operations (id TEXT PRIMARY KEY, node TEXT NOT NULL, dest TEXT, done INTEGER NOT NULL DEFAULT 0,
  result TEXT, phase TEXT NOT NULL, cancel_requested INTEGER NOT NULL DEFAULT 0, metadata TEXT NOT NULL,
  error TEXT, response TEXT, created REAL NOT NULL, updated REAL NOT NULL);
INSERT INTO hosts VALUES ('gpu-1', 'http://gpu-1:7070', 'spare', '{}', 1.0);
""")
    db.commit()
    db.close()
    s = Store(old)
    assert s.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert "generation" in {r["name"] for r in s.db.execute("PRAGMA table_info(hosts)")}
    assert s.host("gpu-1").role == "spare"
    s.db.execute(f"PRAGMA user_version={len(MIGRATIONS) + 1}")
    s.db.close()
    with pytest.raises(FailedPrecondition, match="newer than this pitstop"):
        Store(old)

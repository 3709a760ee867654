"""The evacuation's state is one typed record (wire/evacuation.py), stored whole, with a schema
version and a migration for databases an earlier release wrote.

tests/data/coordinator-0.1.0.db is such a database, written by a real coordinator of the release
before the record was typed (an evacuation that succeeded, and one cancelled and rolled back):
the upgrade must read every operation, keep its shape, and serve it as before."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from pitstop.coordinator.planner import Plan
from pitstop.coordinator.schema import MIGRATIONS
from pitstop.coordinator.service import operation_view
from pitstop.coordinator.sqlitestore import Store
from pitstop.errors import FailedPrecondition
from pitstop.wire.capture_report import CaptureReport
from pitstop.wire.evacuation import SCHEMA_VERSION, EvacuationState
from pitstop.wire.store_rows import StoredHost, StoredWorker

OLD_DB = Path(__file__).parent / "data" / "coordinator-0.1.0.db"


def _raw_ops(path: Path) -> dict[str, dict]:
    db = sqlite3.connect(path)
    try:
        return {i: json.loads(m) for i, m in db.execute("SELECT id, metadata FROM operations")}
    finally:
        db.close()


def test_a_database_of_the_previous_release_is_read_whole_and_served_as_before(tmp_path):
    path = tmp_path / "c.db"
    shutil.copy(OLD_DB, path)
    before = _raw_ops(path)
    assert len(before) == 2 and all("schema_version" not in md for md in before.values())
    s = Store(path)
    try:
        assert s.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        ops = {op.id: op for op in s.ops()}
        for op_id, old in before.items():
            md = ops[op_id].metadata
            assert md == {**old, "schema_version": SCHEMA_VERSION}  # the shape operators read is unchanged
            state = EvacuationState.load(md)
            assert state.dump() == md
            view = operation_view(ops[op_id])
            assert view["metadata"]["node"] == state.node and view["done"]
        by_result = {op.result: EvacuationState.load(op.metadata) for op in ops.values()}
        ok, undone = by_result["succeeded"], by_result["cancelled"]
        assert ok.committed and ok.downtime_s is not None and ok.downtime_s > 0
        assert [w.state for w in ok.workers.values()] == ["committed"] and ok.reason == "maintenance"
        assert {c.type for c in ok.conditions} >= {"Planned", "Quiesced", "Committed", "Succeeded"}
        assert not undone.committed and all(w.state == "rolled_back" for w in undone.workers.values())
    finally:
        s.db.close()
    # a second start finds nothing more to do
    s = Store(path)
    assert {op.id: op.metadata for op in s.ops()} == {i: {**m, "schema_version": 1} for i, m in before.items()}
    s.db.close()


def test_a_record_this_release_cannot_read_stops_the_upgrade_and_names_the_operation(tmp_path):
    path = tmp_path / "c.db"
    shutil.copy(OLD_DB, path)
    db = sqlite3.connect(path)
    op_id, md = db.execute("SELECT id, metadata FROM operations LIMIT 1").fetchone()
    bad = {**json.loads(md), "workers": {"j.0": {"job": "j", "state": "teleported"}}}
    db.execute("UPDATE operations SET metadata=? WHERE id=?", (json.dumps(bad), op_id))
    db.commit()
    version = db.execute("PRAGMA user_version").fetchone()[0]
    db.close()
    with pytest.raises(FailedPrecondition, match=f"operation {op_id} .* cannot be read") as e:
        Store(path)
    assert e.value.code == "database_unreadable"
    db = sqlite3.connect(path)  # nothing was changed: the step's transaction rolled back
    assert db.execute("PRAGMA user_version").fetchone()[0] == version
    assert json.loads(db.execute("SELECT metadata FROM operations WHERE id=?", (op_id,)).fetchone()[0]) == bad
    db.close()


def _plan() -> Plan:
    w = lambda wid, rank, host, addr=None: StoredWorker(id=wid, job="j", rank=rank, host=host,  # noqa: E731
                                                        state="running", updated=0.0, address=addr)
    h = lambda name: StoredHost(name=name, url=f"http://{name}:7070", role="active", last_seen=0.0, age_s=0.0)  # noqa: E731
    return Plan(node=h("a"), dest=h("s"), jobs=["j"],
                leaving=[w("j.1", 1, "a", "10.0.0.2/24")], peers=[w("j.0", 0, "b", "10.0.0.1/24")])


def test_what_the_driver_changes_in_place_is_written_and_fields_appear_once_set():
    st = EvacuationState.new(_plan(), "drain", requested_by="alice")
    d = st.dump()
    assert d["@type"] == "type.pitstop.dev/EvacuateMetadata" and d["schema_version"] == SCHEMA_VERSION
    assert d["keep_peers"] == ["10.0.0.1", "10.0.0.2"] and d["capture_begun"] is False
    assert "first_pause" not in d and "cut" not in d  # as before: a key appears once something set it
    st.phases["pause"] = 0.1  # in place, never through __setattr__
    st.paused.append("j.0")
    st.cut = {"used": True, "destroyed": True}  # validated into the typed record
    st.workers["j.1"].captured(CaptureReport(id="cap-1", worker_id="j.1", state="sent", bytes_total=100,
                                             phases={"dump": 0.2}, post_copy={"lazy_bytes": 40},
                                             pre_copy={"parent_bytes": 60, "by": "criu"}))
    st.totals()
    st.set_condition("Planned", True, "SpareSelected", "1 worker")
    st.set_condition("Planned", False, "Changed")  # one condition per type: the latest word
    d = st.dump()
    assert d["phases"] == {"pause": 0.1} and d["paused"] == ["j.0"] and d["cut"] == {"used": True, "destroyed": True}
    w = d["workers"]["j.1"]
    assert w["state"] == "captured" and w["bytes_done"] == 100 and w["bytes_pre_copied"] == 60
    assert w["pre_copy_by"] == "criu" and d["bytes_after_resume"] == 40 and d["bytes_total"] == 100
    assert [(c["type"], c["status"]) for c in d["conditions"]] == [("Planned", "False")]
    assert "lastTransitionTime" in d["conditions"][0]
    assert EvacuationState.load(d).dump() == d
    st.pre_copy_bytes_total = 5  # an estimate while a pre-copy runs, then taken out of the record
    assert st.dump()["pre_copy_bytes_total"] == 5
    st.unset("pre_copy_bytes_total")
    assert "pre_copy_bytes_total" not in st.dump()
    with pytest.raises(ValueError):
        st.workers["j.1"].state = "teleported"  # a misspelt step is an error where it is written


def test_keys_of_another_release_are_kept_and_a_pre_version_record_is_possibly_captured():
    d = EvacuationState.new(_plan(), "drain").dump()
    newer = {**d, "schema_version": SCHEMA_VERSION + 1, "gpu_bytes": 7}
    assert EvacuationState.load(newer).dump() == newer
    old = {k: v for k, v in d.items() if k not in ("schema_version", "capture_begun")}
    st = EvacuationState.load(old)
    assert st.schema_version == 1 and st.capture_begun  # a rollback then looks for captures on the node

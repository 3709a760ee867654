"""A snapshot's record and a recovery's state are typed, versioned models (wire/snapshot_record.py,
wire/recovery_state.py), with migrations for the databases an earlier release wrote.

tests/data/coordinator-41f7d2e.db was written by the store of the release before they were typed
(41f7d2e), holding records shaped as its coordinator writes them: a committed snapshot of an NCCL
job (its cut's counts and phases), a failed one and one left under way, and a recovery that
succeeded.  The upgrade must read every record, keep its shape, and serve it as before; a record
it cannot read stops the upgrade naming it, and changes nothing."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from pitstop.coordinator.ledger import recovery_entry
from pitstop.coordinator.recovery import is_recovery
from pitstop.coordinator.schema import MIGRATIONS
from pitstop.coordinator.sqlitestore import Store
from pitstop.errors import FailedPrecondition
from pitstop.wire.recovery_state import TYPE_URL as RECOVERY_TYPE_URL
from pitstop.wire.recovery_state import RecoveryState
from pitstop.wire.snapshot_record import SCHEMA_VERSION, SnapshotPart, SnapshotRecord
from pitstop.wire.store_rows import StoredOp

OLD_DB = Path(__file__).parent / "data" / "coordinator-41f7d2e.db"


def _raw(path: Path) -> dict[int, dict]:
    db = sqlite3.connect(path)
    try:
        return {n: json.loads(i) for n, i in db.execute("SELECT number, info FROM snapshots WHERE job='train'")}
    finally:
        db.close()


def test_the_previous_releases_snapshot_records_are_read_whole_and_served_as_before(tmp_path):
    path = tmp_path / "c.db"
    shutil.copy(OLD_DB, path)
    before = _raw(path)
    assert sorted(before) == [1, 2, 3] and all("schema_version" not in r for r in before.values())
    s = Store(path)
    try:
        assert s.db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        snaps = {x.number: x for x in s.snapshots("train")}
        assert {n: x.state for n, x in snaps.items()} == {1: "committed", 2: "failed", 3: "taking"}
        for n, old in before.items():
            public = snaps[n].public()
            assert {k: v for k, v in public.items() if k not in ("job", "number", "state", "created")} == \
                {**old, "schema_version": SCHEMA_VERSION}  # the shape operators read is unchanged
        done = snaps[1].record
        assert done.pause == "nccl_cut" and done.parts["train.1"] == SnapshotPart(host="host-b", rank=1, buddy="host-a")
        assert done.issued == {"train.0": 120, "train.1": 120} and done.phases["replicate"] == 1.2
        assert snaps[2].record.error == "host-b could not replicate its part"
        assert snaps[3].record.whole == {"host-a": "its buddy changed from c to b"}
    finally:
        s.db.close()
    again = Store(path)  # a second start finds nothing more to do
    try:
        assert _raw(path) == {n: {**r, "schema_version": 1} for n, r in before.items()}
    finally:
        again.db.close()


def test_a_snapshot_record_this_release_cannot_read_stops_the_upgrade_and_names_it(tmp_path):
    path = tmp_path / "c.db"
    shutil.copy(OLD_DB, path)
    db = sqlite3.connect(path)
    bad = {**_raw(path)[2], "pause": "teleported"}
    db.execute("UPDATE snapshots SET info=? WHERE job='train' AND number=2", (json.dumps(bad),))
    db.commit()
    version = db.execute("PRAGMA user_version").fetchone()[0]
    db.close()
    with pytest.raises(FailedPrecondition, match="snapshot 2 of job train .* cannot be read") as e:
        Store(path)
    assert e.value.code == "database_unreadable"
    db = sqlite3.connect(path)  # nothing was changed: the step's transaction rolled back
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == version
        assert json.loads(db.execute("SELECT info FROM snapshots WHERE number=1").fetchone()[0]).get(
            "schema_version") is None
    finally:
        db.close()


def test_a_record_shows_only_what_was_set_and_keeps_what_a_newer_release_wrote():
    r = SnapshotRecord(parts={"j.0": SnapshotPart(host="a", rank=0, buddy="b")}, buddies={"a": "b"})
    r.phases["check"] = 0.1  # changed in place: still written
    assert r.dump() == {"schema_version": SCHEMA_VERSION, "parts": {"j.0": {"host": "a", "rank": 0, "buddy": "b"}},
                        "buddies": {"a": "b"}, "phases": {"check": 0.1}}
    newer = SnapshotRecord.load({"schema_version": 2, "parts": {}, "replica_checksum": "abc"})
    assert newer.dump()["replica_checksum"] == "abc"  # a downgrade never truncates a record
    with pytest.raises(ValueError):
        SnapshotRecord.load({"parts": {"j.0": {"host": "a"}}})  # a part without its rank and buddy


def _raw_op(path: Path, op_id: str) -> dict:
    db = sqlite3.connect(path)
    try:
        return json.loads(db.execute("SELECT metadata FROM operations WHERE id=?", (op_id,)).fetchone()[0])
    finally:
        db.close()


def test_the_previous_releases_recovery_is_read_whole_and_served_as_before(tmp_path):
    path = tmp_path / "c.db"
    shutil.copy(OLD_DB, path)
    before = _raw_op(path, "recover-0123456789ab")
    assert "schema_version" not in before
    s = Store(path)
    try:
        op = s.op("recover-0123456789ab")
        assert op.metadata == {**before, "schema_version": 1}  # the shape operators read is unchanged
        md = RecoveryState.load(op.metadata)
        assert md.dump() == op.metadata
        assert md.job == "train" and md.node == "host-b" and md.snapshot == 1 and md.lost_ranks == [1]
        assert md.steps_redone == 12.0 and md.restored["train.0"]["files_cut_back"] == ["/data/log.txt"]
        entry = recovery_entry(op)  # the ledger reads it as before
        assert entry["pause_s"] == entry["downtime_s"] == 3.1
    finally:
        s.db.close()


def test_a_recovery_this_release_cannot_read_stops_the_upgrade_and_names_it(tmp_path):
    path = tmp_path / "c.db"
    shutil.copy(OLD_DB, path)
    bad = {**_raw_op(path, "recover-0123456789ab"), "snapshot": "the newest"}
    db = sqlite3.connect(path)
    db.execute("UPDATE operations SET metadata=? WHERE id='recover-0123456789ab'", (json.dumps(bad),))
    db.commit()
    db.close()
    with pytest.raises(FailedPrecondition, match="recovery recover-0123456789ab .* cannot be read") as e:
        Store(path)
    assert e.value.code == "database_unreadable"
    db = sqlite3.connect(path)  # the steps before it are done; its own transaction rolled back
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS) - 1
    finally:
        db.close()
    assert _raw_op(path, "recover-0123456789ab") == bad


def test_a_new_recovery_says_what_it_is_and_its_version():
    """The watchdogs tell a recovery from an evacuation by its @type: a record without it would be
    taken over as a stray evacuation."""
    md = RecoveryState(job="j", node="host-b", snapshot=3, phases={}, conditions=[]).dump()
    assert md == {"@type": RECOVERY_TYPE_URL, "schema_version": 1, "job": "j", "node": "host-b", "snapshot": 3,
                  "phases": {}, "conditions": []}
    assert is_recovery(StoredOp(id="recover-1", node="host-b", metadata=md, created=0.0, updated=0.0))

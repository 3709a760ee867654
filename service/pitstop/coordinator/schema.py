"""The coordinator's database schema, one for SQLite and PostgreSQL, and the ordered migrations
that bring a database written by any earlier release to it (coordinator/store.py runs them).

Why apart from the records: a schema change is a release's contract with every database already
out there.  Each migration is written once, here, tested against a database file written by an
earlier release (tests/test_store_backends.py, tests/test_evacuation_state.py), and never edited
once shipped."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from pitstop.errors import FailedPrecondition
from pitstop.wire.evacuation import EvacuationState
from pitstop.wire.records import Record
from pitstop.wire.recovery_state import TYPE_URL as RECOVERY_TYPE_URL
from pitstop.wire.recovery_state import RecoveryState
from pitstop.wire.snapshot_record import SnapshotRecord


class Migrating(Protocol):
    """What a migration asks of the database it runs in (coordinator/store.py BaseStore)."""

    def q(self, sql: str, args: tuple = ()) -> list[Mapping[str, Any]]: ...

    def columns(self, table: str) -> set[str]: ...


# One schema for both databases: types both read the same way (SQLite's affinity takes DOUBLE
# PRECISION as REAL and BIGINT as INTEGER; PostgreSQL's REAL would be 4 bytes and its INTEGER too
# small for a fence's epoch, milliseconds since 1970).
SCHEMA = """
CREATE TABLE IF NOT EXISTS hosts (
  name TEXT PRIMARY KEY, url TEXT NOT NULL, role TEXT NOT NULL, info TEXT NOT NULL, last_seen DOUBLE PRECISION NOT NULL,
  generation TEXT, cordon TEXT, role_since DOUBLE PRECISION, role_why TEXT);
CREATE TABLE IF NOT EXISTS workers (
  id TEXT PRIMARY KEY, job TEXT NOT NULL, rank BIGINT NOT NULL, host TEXT NOT NULL, state TEXT NOT NULL,
  info TEXT NOT NULL, updated DOUBLE PRECISION NOT NULL, left_behind TEXT);
CREATE TABLE IF NOT EXISTS operations (
  id TEXT PRIMARY KEY, node TEXT NOT NULL, dest TEXT, done BIGINT NOT NULL DEFAULT 0,
  result TEXT, phase TEXT NOT NULL, cancel_requested BIGINT NOT NULL DEFAULT 0,
  metadata TEXT NOT NULL, error TEXT, response TEXT, created DOUBLE PRECISION NOT NULL,
  updated DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS idempotency (
  key TEXT PRIMARY KEY, body_hash TEXT NOT NULL, op_id TEXT NOT NULL, created DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS snapshot_policy (
  job TEXT PRIMARY KEY, every_s DOUBLE PRECISION NOT NULL, updated DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
  job TEXT NOT NULL, number BIGINT NOT NULL, state TEXT NOT NULL, created DOUBLE PRECISION NOT NULL, info TEXT NOT NULL,
  PRIMARY KEY (job, number));
CREATE TABLE IF NOT EXISTS fences (
  job TEXT NOT NULL, host TEXT NOT NULL, epoch BIGINT NOT NULL, acked BIGINT NOT NULL DEFAULT 0,
  created DOUBLE PRECISION NOT NULL, PRIMARY KEY (job, host));
"""

LEADERSHIP = """
CREATE TABLE IF NOT EXISTS leadership (
  id BIGINT PRIMARY KEY, term BIGINT NOT NULL, holder TEXT, url TEXT, since DOUBLE PRECISION,
  expires DOUBLE PRECISION NOT NULL, renewed DOUBLE PRECISION)
"""
"""The lease (coordinator/leadership.py): one row, id 1.  `term` only grows; the coordinator that
holds it (`holder`, reached at `url`) leads until `expires`, in the database's own clock."""


def _add_generation(db: Migrating) -> None:
    if "generation" not in db.columns("hosts"):
        db.q("ALTER TABLE hosts ADD COLUMN generation TEXT")  # a database from before beats


def _index_operations(db: Migrating) -> None:
    db.q("CREATE INDEX IF NOT EXISTS operations_by_created ON operations(created)")
    db.q("CREATE INDEX IF NOT EXISTS operations_by_node ON operations(node, created)")


_REMOVE_ROW = "run the release that wrote it, or remove that operation's row"


def _read(load: Callable[[dict[str, Any]], Record], stored: str, what: str, action: str) -> str:
    """A stored record through this release's model, as JSON again.  One it cannot read stops the
    upgrade here, naming it (the step's transaction rolls back), rather than the code that would
    read it later."""
    try:
        return json.dumps(load(json.loads(stored)).dump())
    except (ValueError, TypeError) as e:
        raise FailedPrecondition(f"{what} in the coordinator's database cannot be read by this release: {e}",
                                 code="database_unreadable", action=action) from None


def _typed_operation_state(db: Migrating) -> None:
    """Every operation's metadata through the typed evacuation state (wire/evacuation.py): a record
    of an earlier release gets its schema version, and one this release cannot read stops the
    upgrade here, naming the operation, rather than the driver that would reconcile it later."""
    for r in db.q("SELECT id, metadata FROM operations"):
        md = _read(EvacuationState.load, r["metadata"], f"operation {r['id']}", _REMOVE_ROW)
        db.q("UPDATE operations SET metadata=? WHERE id=?", (md, r["id"]))


def _add_cordon(db: Migrating) -> None:
    if "cordon" not in db.columns("hosts"):
        db.q("ALTER TABLE hosts ADD COLUMN cordon TEXT")  # a host kept out of the spare pool: why, since, who


def _add_role_change(db: Migrating) -> None:
    have = db.columns("hosts")
    if "role_since" not in have:  # when a host took its role, and why (an evacuation's reason, who asked)
        db.q("ALTER TABLE hosts ADD COLUMN role_since REAL")
    if "role_why" not in have:
        db.q("ALTER TABLE hosts ADD COLUMN role_why TEXT")


def _add_leadership(db: Migrating) -> None:
    """The lease that one coordinator of several holds (coordinator/leadership.py), at term 0 and
    expired: the first coordinator to start takes term 1."""
    db.q(LEADERSHIP)
    db.q("INSERT INTO leadership(id, term, expires) VALUES(1, 0, 0) ON CONFLICT(id) DO NOTHING")


def _add_left_behind(db: Migrating) -> None:
    if "left_behind" not in db.columns("workers"):  # the copy a worker's move or recovery left (set_worker_host)
        db.q("ALTER TABLE workers ADD COLUMN left_behind TEXT")


def _typed_snapshot_records(db: Migrating) -> None:
    """Every snapshot's record through the typed model (wire/snapshot_record.py), as
    _typed_operation_state did for the evacuations: a record of an earlier release gets its schema
    version, and one this release cannot read stops the upgrade here, naming the snapshot."""
    for r in db.q("SELECT job, number, info FROM snapshots"):
        rec = _read(SnapshotRecord.load, r["info"], f"snapshot {r['number']} of job {r['job']}",
                    "run the release that wrote it, or drop the job's snapshots (`pitstop snapshots JOB --drop` "
                    "with that release)")
        db.q("UPDATE snapshots SET info=? WHERE job=? AND number=?", (rec, r["job"], r["number"]))


def _typed_recovery_records(db: Migrating) -> None:
    """Every recovery's metadata through its typed model (wire/recovery_state.py)."""
    for r in db.q("SELECT id, metadata FROM operations"):
        if json.loads(r["metadata"]).get("@type") != RECOVERY_TYPE_URL:
            continue
        md = _read(RecoveryState.load, r["metadata"], f"recovery {r['id']}", _REMOVE_ROW)
        db.q("UPDATE operations SET metadata=? WHERE id=?", (md, r["id"]))


MIGRATIONS: tuple[Callable[[Migrating], None], ...] = (_add_generation, _index_operations,
                                                        _typed_operation_state, _add_cordon,
                                                        _add_role_change, _add_leadership, _add_left_behind,
                                                        _typed_snapshot_records, _typed_recovery_records)
"""Ordered: a database at schema version N (SQLite: PRAGMA user_version; PostgreSQL: the
schema_version table) gets MIGRATIONS[N:], each in its own transaction with the version it
reaches.  Append only; never edit one that shipped."""

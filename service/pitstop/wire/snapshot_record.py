"""A snapshot's record: what the coordinator keeps of each snapshot of a job (coordinator/snapshots.py),
what a recovery reads back (coordinator/recovery.py), and what `GET /v1/jobs/{job}/snapshots` and
`pitstop snapshots` show.

Why typed: the record is written at every step of a snapshot (taking, replicating, committed or
failed), read back by a restarted coordinator to undo a pause it left, and by a recovery to know
where every part and replica is.  As a dict its keys were spelt in three modules; a key misspelt
in one of them read as None.  `schema_version` says which shape a stored record has;
`SnapshotRecord.load` brings an older one up to date, and the store's migration rewrites every
stored record through it once (coordinator/schema.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from pitstop.wire.records import Record

SCHEMA_VERSION = 1

SnapshotState = Literal["taking", "replicating", "committed", "failed"]
Pause = Literal["nccl_cut", "sigstop"]


class SnapshotPart(Record):
    """One rank's part: the host that dumped it, and the host that keeps its replica."""

    host: str
    rank: int
    buddy: str
    # Once dumped: how many processes its rank's tree had, and where the agent's time in the pause
    # went (agent/snapshots.py Laps: tree, gpu, criu, track_reset, seal_and_files, manifest)
    processes: int | None = None
    steps: dict[str, float] = Field(default_factory=dict)


class SnapshotRecord(Record):
    always = ("schema_version",)
    schema_version: int = SCHEMA_VERSION
    parts: dict[str, SnapshotPart] = Field(default_factory=dict)  # worker -> where its part and replica are
    buddies: dict[str, str] = Field(default_factory=dict)  # host -> the host that keeps its replicas
    buddy_why: dict[str, str] = Field(default_factory=dict)  # host -> why that buddy
    whole: dict[str, str] = Field(default_factory=dict)  # host -> why its parts are dumped whole
    phases: dict[str, float] = Field(default_factory=dict)  # check, pause, lock, dump, resume, replicate (s)
    pause: Pause | None = None  # how the job pauses: written before it does, for a restart to undo it
    issued: dict[str, int] = Field(default_factory=dict)  # worker -> collectives issued at the cut (progress.py)
    ops_per_step: dict[str, Any] = Field(default_factory=dict)  # worker -> collectives per training step
    cut_rounds: int | None = None
    device_released_bytes: int | None = None
    pause_s: float | None = None  # the pause the job saw
    bytes: int | None = None  # dumped, over every part
    bytes_in_parent: int | None = None  # incremental parts' pages left in the part before them
    incremental: list[str] = Field(default_factory=list)  # workers whose part is a delta
    seconds: float | None = None  # from its start to its commit
    error: str | None = None  # why it failed

    @classmethod
    def load(cls, stored: dict[str, Any]) -> "SnapshotRecord":
        """A stored record, of this schema or an older one, as this release's model."""
        return cls.model_validate(migrate(stored))


def migrate(stored: dict[str, Any]) -> dict[str, Any]:
    """An older record brought to SCHEMA_VERSION, as a plain dict (nothing is validated here).

    0 -> 1: records written before the schema was versioned.  Their shape is this one's, less the
    version; a record of a snapshot under way when its coordinator stopped may still hold
    `pause_started` (a monotonic clock reading of a process that is gone): dropped."""
    out = dict(stored)
    version = int(out.get("schema_version", 0))
    if version > SCHEMA_VERSION:
        return out  # a newer release's record: read what this one knows, keep the rest (extra="allow")
    if version == 0:
        out.pop("pause_started", None)
        out["schema_version"] = 1
    return out


class StoredSnapshot(Record):
    """A row of the store's snapshots table: which snapshot, its state, and its record."""

    job: str
    number: int
    state: SnapshotState
    created: float
    record: SnapshotRecord

    def public(self) -> dict[str, Any]:
        """As the REST API shows it: the row's columns and the record's fields side by side."""
        return {"job": self.job, "number": self.number, "state": self.state, "created": self.created,
                **self.record.dump()}

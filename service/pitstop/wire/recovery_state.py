"""A recovery's state: the metadata of its AIP-151 operation (coordinator/recovery.py), typed.

Why typed: the record is written at every phase (plan, fence, stop, restore, resume), read back
by a restarted coordinator that runs the recovery again, and shown by `pitstop ops`, the ledger
and the dashboard.  As a dict its keys were written in one module and read in four.  Shape on the
wire and in the database: what was set, exactly as before it was typed (wire/records.py).
`schema_version` says which shape a stored record has; `RecoveryState.load` brings an older one
up to date, and the store's migration rewrites every stored recovery through it once
(coordinator/schema.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from pitstop.wire.records import Record

SCHEMA_VERSION = 1
TYPE_URL = "type.pitstop.dev/RecoverMetadata"


class RecoveryState(Record):
    always = ("type_url", "schema_version")
    type_url: str = Field(default=TYPE_URL, alias="@type")
    schema_version: int = SCHEMA_VERSION
    job: str
    node: str  # the failed host
    snapshot: int  # the committed snapshot the job rolls back to
    snapshot_age_s: float | None = None
    requested_by: str = ""
    cause: str = ""
    detected_after_s: float | None = None  # from the failure to the recovery's start, where known
    phase: str | None = None
    phases: dict[str, float] = Field(default_factory=dict)  # each phase's seconds
    conditions: list[dict[str, Any]] = Field(default_factory=list)
    lost_ranks: list[int] = Field(default_factory=list)
    lost_s: float | None = None  # work the job redoes: since the snapshot
    fence_epoch: int | None = None
    fenced_now: bool | None = None  # the lost host answered, and was told of its fence at once
    ops_redone: int | None = None
    steps_redone: float | None = None
    steps_redone_why: str | None = None
    survivors: dict[str, Any] = Field(default_factory=dict)  # what each surviving rank was doing when stopped
    destination: str | None = None  # the spare the lost ranks went to
    spares_failed: list[dict[str, Any]] = Field(default_factory=list)
    replicas_sent: dict[str, Any] = Field(default_factory=dict)
    restored: dict[str, Any] = Field(default_factory=dict)  # worker -> how its restore went
    files: dict[str, Any] = Field(default_factory=dict)  # the files cut back to the snapshot
    pause_s: float | None = None
    spares_left: int | None = None
    result: str | None = None

    @classmethod
    def load(cls, stored: dict[str, Any]) -> "RecoveryState":
        """A stored record, of this schema or an older one, as this release's model."""
        return cls.model_validate(migrate(stored))


def migrate(stored: dict[str, Any]) -> dict[str, Any]:
    """An older record brought to SCHEMA_VERSION, as a plain dict (nothing is validated here).

    0 -> 1: records written before the schema was versioned: their shape is this one's, less the
    version."""
    out = dict(stored)
    version = int(out.get("schema_version", 0))
    if version == 0:
        out["schema_version"] = 1
    return out

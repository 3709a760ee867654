"""The coordinator's rows (hosts, workers, fences, operations), as the store hands them back and
the REST API shows them (`GET /v1/hosts`, `GET /v1/jobs`, a job's snapshots' fences).

Why typed: the planner, the recovery, the snapshots, the routes and the lifecycle each read a
rank's host, state and end from the same row; as dicts each spelt the keys again, and a misspelt
one read as None.  The row is what the store keeps of the last report (a subset: the agent's own
report, wire/worker_report.py, is the whole), so it is frozen: a change goes through the store.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Row(BaseModel):
    def public(self) -> dict[str, Any]:
        """As the REST API shows it (the keys it always showed)."""
        return self.model_dump(mode="json")


class StoredHost(_Row):
    """A host: the role the coordinator gave it (since when, why), an operator's cordon, when its
    agent was last heard from, and its agent's last full report (wire/coordinator_requests.Heartbeat
    less its workers), which the planner and the recoveries choose destinations by."""

    # What an agent of another release reported beyond these fields is kept and shown, not dropped.
    model_config = ConfigDict(extra="allow")

    name: str
    url: str
    role: str                                  # active, spare, draining, drained (ROLES)
    offers_spare: bool = False                 # its agent runs with --spare
    cordoned: dict[str, Any] | None = None     # {"reason", "since", "by"}: kept out of the spare pool
    role_since: float | None = None
    role_why: dict[str, Any] | None = None
    last_seen: float
    age_s: float
    slurm_node: str | None = None
    failure_domain: str | None = None
    socket: str | None = None
    gpus: list[dict[str, Any]] = Field(default_factory=list)
    gpu_model: str | None = None
    gpu_count: int = 0
    gpu_note: str = ""
    driver: str | None = None
    cap_bnd: str | None = None
    gpu_health: list[dict[str, Any]] = Field(default_factory=list)
    health: dict[str, Any] | None = None       # the health policy's verdict: {"degraded", "reasons"}
    coordinator_term: int | None = None

    def report(self) -> dict[str, Any]:
        """Its agent's last report as it came (what Store.heartbeat keeps): a report again with fresher workers."""
        out = self.model_dump(exclude={"role", "offers_spare", "cordoned", "role_since", "role_why", "last_seen",
                                       "age_s"}, exclude_unset=True)
        return out | {"spare": self.offers_spare}


class StoredWorker(_Row):
    """A rank where the coordinator last knew it: its host, its state (the agent's, or `claimed`
    while it registers) and what the planner and the recovery read of its last report."""

    model_config = ConfigDict(frozen=True)

    id: str
    job: str
    rank: int
    host: str
    state: str                       # WorkerState, or store.CLAIMED
    updated: float                   # when the row was last written (wall clock)
    address: str | None = None       # its own address (A.B.C.D/P) where it has one: moves with it
    caps: str | None = None          # what a restore must grant it (proc/caps.py, hex)
    unmovable: str | None = None     # why it cannot be moved, as its NCCL shim said
    slurm_job: str | None = None
    snapshot_every_s: float | None = None
    world: int | None = None
    exit_code: int | None = None
    ended_at: float | None = None
    end_asked: bool | None = None
    peer_lost: str | None = None     # its shim holds a communicator error back for a recovery


class StoredFence(_Row):
    """A job fenced off a host: it was recovered elsewhere while that host was away, and its
    ranks there are ended for good when the host is heard from again (`acked` once it said so)."""

    model_config = ConfigDict(frozen=True)

    job: str
    host: str
    epoch: int
    acked: bool
    created: float


class StoredOp(_Row):
    """An operation's row (an evacuation or a recovery): its columns, and its record (`metadata`,
    read as its own model by evacuation.EvacuationState / recovery_state.RecoveryState)."""

    model_config = ConfigDict(frozen=True)

    id: str
    node: str
    metadata: dict[str, Any]
    created: float
    updated: float
    phase: str = "pending"
    dest: str | None = None
    done: bool = False              # the columns' own defaults (coordinator/schema.py)
    result: str | None = None
    cancel_requested: bool = False
    error: dict[str, Any] | None = None
    response: dict[str, Any] | None = None

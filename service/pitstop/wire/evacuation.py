"""An evacuation's state: the metadata of its AIP-151 operation, typed.

The coordinator's driver keeps this record, writes it whole with every change (so a restarted
coordinator knows whom to resume, what was captured and whether the commit point was passed),
and serves it as the operation's `metadata`.  It is one typed model rather than a dict because
about a hundred reads and writes in the driver, the API's view and the CLI share it: a key
misspelt in one of them would be a silent None; here it is an AttributeError in a test.

Shape on the wire and in the database: `model_dump(by_alias=True, exclude_unset=True)`, so a
field appears once something set it, exactly as the record looked before it was typed, and an
operator's tools reading `metadata` see no difference.  `schema_version` says which shape a
stored record has; `EvacuationState.load` brings an older one up to date (the store's migration
rewrites every stored record through it once, coordinator/store.py).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from pitstop.wire.capture_report import CaptureReport
from pitstop.wire.records import Record
from pitstop.wire.store_rows import StoredHost, StoredWorker

SCHEMA_VERSION = 1
TYPE_URL = "type.pitstop.dev/EvacuateMetadata"

WorkerStep = Literal["pending", "capturing", "captured", "released", "restored", "committed", "rolled_back"]
PauseEnd = Literal["last resume", "first step", "fill end"]  # what ended the job's pause (coordinator/ledger.py)


class WorkerProgress(Record):
    """One leaving worker: where its move stands, and what its capture and restore reported."""

    job: str
    rank: int | None = None
    state: WorkerStep = "pending"
    capture_id: str | None = None
    bytes_done: int = 0
    bytes_total: int | None = None
    capture_phases: dict[str, Any] = Field(default_factory=dict)  # the source's phases, seconds
    bytes_deduplicated: int = 0
    compression: dict[str, Any] | None = None  # what went compressed, and the rates the source measured
    bytes_pre_copied: int | None = None  # sent ahead while the job ran; not again during the pause
    pre_copy_tracked_tasks: int | None = None  # how the source told what changed: the kernel's tracking,
    pre_copy_digested_tasks: int | None = None  # or digests
    pre_copy_by: str | None = None  # who cut the delta: CRIU's incremental dump ("criu") or pitstop
    pre_copy_untracked_reason: str | None = None
    pre_copy_compression: dict[str, Any] | None = None
    bytes_after_resume: int | None = None  # network post-copy: these follow after the resume
    restored_pid: int | None = None
    left_copy: dict[str, int] | None = None  # the source's copy, {"pid", "start_time"}, as its capture said
    restore_phases: dict[str, Any] = Field(default_factory=dict)
    fill: dict[str, Any] | None = None  # network post-copy: how the destination's fill ended
    # Device memory released at the cut before the CUDA checkpoint (shim/trim.c): what released it
    # ("torch", "cuda_mempool"; none: nothing reachable), bytes reserved before and after.
    device_memory: dict[str, Any] | None = None

    def captured(self, cap: CaptureReport) -> None:
        """Take in the source agent's report of the finished capture."""
        self.state = "captured"
        self.bytes_total = cap.bytes_total
        self.bytes_done = self.bytes_total or self.bytes_done
        self.capture_phases = cap.phases
        self.bytes_deduplicated = cap.bytes_deduplicated
        if cap.source_pid is not None:
            self.left_copy = {"pid": cap.source_pid, "start_time": cap.source_start_time or 0}
        if cap.compression:
            self.compression = cap.compression
        pre = cap.pre_copy
        if pre:
            self.bytes_pre_copied = pre.get("parent_bytes", 0)
            self.pre_copy_tracked_tasks = pre.get("tracked_tasks", 0)
            self.pre_copy_digested_tasks = pre.get("digested_tasks", 0)
            self.pre_copy_by = pre.get("by")
            if pre.get("untracked_reason"):
                self.pre_copy_untracked_reason = pre["untracked_reason"]
        if cap.post_copy:
            self.bytes_after_resume = cap.post_copy.get("lazy_bytes", 0)


class CutRecord(Record):
    """The NCCL consistent cut, where the job's ranks use the shim."""

    used: bool = False
    destroyed: bool = False  # the real communicators are gone: a rollback must re-create them
    rounds: int | None = None
    seconds: float | None = None
    rewired: bool | None = None
    new_ids: dict[str, str] | None = None  # communicator -> the first 32 hex digits of its new unique id
    trim_s: float | None = None  # the leaving ranks' release of unused device memory (in the pause)
    # The early rewire (coordinator/cut.py): the ranks that stay re-create their communicators while the
    # leaving ones are captured and restored.  The full unique ids they rebuild with, recorded before
    # any of them is told: a rollback (a restarted coordinator's too) has the rolled-back sources join
    # with the same ids, unless the restored ranks were already told to (`early_joined`), or a rank
    # failed: then the rebuild is abandoned and redone in place.
    early_ids: dict[str, str] | None = None  # until the rewire ends (then in new_ids, shortened)
    early_joined: bool | None = None
    early: bool | None = None  # the ranks that stay were told to begin (True), or the rewire waited (False)
    prewire_s: float | None = None  # from the capture's start until every rank that stays was rebuilding
    early_why_not: str | None = None  # why the rewire waited for the restore (setting, an older shim, ...)


class Condition(Record):
    """A Kubernetes-style condition: the latest word on one aspect of the operation."""

    type: str
    status: Literal["True", "False"]
    reason: str
    message: str = ""
    last_transition_time: str = Field(alias="lastTransitionTime")


class MovePlan(Record):
    """How the move goes, settled once by the coordinator before anything pauses and carried to the
    agents as explicit values: every later step reads it instead of deciding again."""

    pre_copy: bool  # memory sent ahead while the job runs (never with network post-copy: nothing to send)
    post_copy: bool  # network post-copy: the leaving workers' memory follows after the resume
    pause: Literal["nccl_cut", "sigstop"] | None = None  # who stops the job; known as the pause begins


class AfterMove(Record):
    """What the job did once it ran again (coordinator/progress.py): the time to useful progress,
    measured from the NCCL shim's counters of collectives each rank issued, not copied from the
    pause.  None of it where the job's collectives are not the shim's to count (`why_not`)."""

    measured: bool
    why_not: str | None = None
    ranks: int | None = None
    # every rank issued two collectives (or sends, receives) after the last resume: its first one had
    # returned (on a CPU, or a GPU job that waits on its results; a GPU launch alone returns at once)
    first_collectives_s: float | None = None
    # ... and when that was (wall clock), timed by the ranks' shims: against the operation's
    # last_restore, what the rewire and the resume left in the pause after the restore
    first_collectives_at: float | None = None
    # the job's collective rate over the trailing second first back to 90 % of its rate before
    back_to_speed_s: float | None = None
    # every rank did a whole step's work after the move: its operations per step (the period of the
    # shim's trail of them before the move) and one more, issued since the cut
    first_step_s: float | None = None
    ops_per_step: int | None = None  # the most any rank issues per step
    rank_pause_s: dict[str, float] | None = None  # per worker, from its parking at the cut to leaving it
    timed_by: Literal["reads", "shim"] = "reads"  # who timed first_*: the watcher's reads, or each op's stamp
    collectives_per_s_before: float | None = None  # per rank, between the move's start and the cut
    collectives_per_s_after: float | None = None  # per rank, over the watch after the first collectives
    step_time_ratio: float | None = None  # the rate before over the rate after: > 1, each step is slower now
    watched_s: float | None = None


class EvacuationState(Record):
    """The operation's metadata: what the request asked, the plan, and where the move stands."""

    always = ("type_url", "schema_version")
    type_url: str = Field(default=TYPE_URL, alias="@type")
    schema_version: int = SCHEMA_VERSION
    node: str
    destination: str
    reason: str = ""
    requested_by: str = ""  # the operator's certificate and token, or the health policy
    post_copy: bool | None = None  # as asked; None: each source agent's setting
    pre_copy: bool | None = None  # as asked; None: the coordinator's setting
    jobs: list[str] = Field(default_factory=list)
    workers: dict[str, WorkerProgress] = Field(default_factory=dict)
    peers: dict[str, str] = Field(default_factory=dict)  # worker -> its host, for the pause and resume
    # Workers with their own addresses keep their connections to each other; any other connection
    # of a moved worker is reset at the destination (network/workerns.py).
    keep_peers: list[str] | None = None
    plan: MovePlan | None = None  # settled as the move begins (coordinator/evacuation_run.py)
    phase: str | None = None
    phases: dict[str, float] = Field(default_factory=dict)  # seconds each phase took
    conditions: list[Condition] = Field(default_factory=list)
    paused: list[str] = Field(default_factory=list)
    cut: CutRecord | None = None
    committed: bool = False
    # From the capture phase on, a rollback looks for captures on the node even unrecorded ones.
    # True where absent: a record from before it existed is treated as possibly captured.
    capture_begun: bool = True
    first_pause: float | None = None
    pause_round_s: float | None = None
    last_restore: float | None = None  # when the last restored worker ran on the destination (its wall clock)
    last_resume: float | None = None
    downtime_s: float | None = None
    # The pause the job saw (coordinator/ledger.job_pause): the downtime, except with post-copy,
    # whose resumed ranks stall on memory still being filled: until the later of the job's first
    # step after the move and the fill's end.  Known as its inputs arrive; until names the end.
    job_pause_s: float | None = None
    job_pause_until: PauseEnd | None = None
    pre_copy_bytes: int | None = None
    pre_copy_bytes_total: int | None = None  # an estimate, while the pre-copy runs
    bytes_done: int = 0
    bytes_total: int | None = None
    bytes_after_resume: int | None = None
    fill_s: float | None = None
    source_cleanup_pending: list[str] | None = None
    after_move: AfterMove | None = None  # written once the job has run a while after the move

    @classmethod
    def new(cls, plan: Any, reason: str, post_copy: bool | None = None, pre_copy: bool | None = None,
            requested_by: str = "") -> "EvacuationState":
        """The record of a new evacuation of `plan` (coordinator/planner.Plan)."""
        node: StoredHost = plan.node
        dest: StoredHost = plan.dest
        leaving: list[StoredWorker] = plan.leaving
        peers: list[StoredWorker] = plan.peers
        return cls(
            type_url=TYPE_URL, schema_version=SCHEMA_VERSION,
            node=node.name, destination=dest.name, reason=reason, requested_by=requested_by,
            post_copy=post_copy, pre_copy=pre_copy, jobs=plan.jobs,
            workers={w.id: WorkerProgress(job=w.job, rank=w.rank, state="pending", capture_id=None,
                                          bytes_done=0, bytes_total=None) for w in leaving},
            peers={w.id: w.host for w in peers},
            keep_peers=sorted({w.address.split("/")[0] for w in leaving + peers if w.address}) or None,
            paused=[], committed=False, capture_begun=False, phases={}, bytes_done=0, bytes_total=None,
            conditions=[], downtime_s=None)

    @classmethod
    def load(cls, stored: dict[str, Any]) -> "EvacuationState":
        """A stored record, of this schema or an older one, as this release's model."""
        return cls.model_validate(migrate(stored))

    def set_condition(self, type_: str, status: bool, reason: str, message: str = "") -> None:
        self.conditions = [c for c in self.conditions if c.type != type_] + [Condition(
            type=type_, status="True" if status else "False", reason=reason, message=message,
            last_transition_time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))]

    def totals(self) -> None:
        """The operation's byte counts, from its workers'."""
        ws = self.workers.values()
        self.bytes_done = sum(w.bytes_done for w in ws)
        self.bytes_total = sum(w.bytes_total or 0 for w in ws)
        self.bytes_after_resume = sum(w.bytes_after_resume or 0 for w in ws)

    def pending_cleanup(self) -> list[str]:
        """Moved workers whose images the node has not freed yet."""
        return [wid for wid, w in self.workers.items() if w.state != "committed"]


def migrate(stored: dict[str, Any]) -> dict[str, Any]:
    """An older record brought to SCHEMA_VERSION, as a plain dict (nothing is validated here).

    0 -> 1: records written before the schema was versioned.  Their shape is this one's, less
    the version; `capture_begun` may be absent (records older than it), which the model's
    default reads as "possibly captured"."""
    out = dict(stored)
    version = int(out.get("schema_version", 0))
    if version > SCHEMA_VERSION:
        return out  # a newer release's record: read what this one knows, keep the rest (extra="allow")
    if version == 0:
        out["schema_version"] = 1
    return out

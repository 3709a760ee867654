"""A worker as its agent reports it: what `GET /v1/workers` and `GET /v1/workers/{id}` answer,
and what AgentClient hands its callers (the coordinator, the launcher, the tests) instead of a dict.

Why typed: the coordinator and the launcher read a worker's state, its fill, where it moved, why
it was lost; as dicts those keys were spelt at every reader, and one misspelt read as None.  The
agent's own record of a worker (agent/state.py Worker) is this report: it serves what it keeps.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

WorkerState = Literal["running", "paused", "capturing", "stopped", "released", "moved", "exited", "lost"]
FillState = Literal["filling", "filled", "failed", "unknown"]


class Fill(BaseModel):
    """A post-copy restore's memory fill.  Until it ends the worker's memory is not all here,
    and with network post-copy its source host must stay up: the coordinator holds the
    evacuation open (and the node `draining`) until every fill has ended."""

    state: FillState = "filling"
    source: str | None = None   # the agent that serves the pages (network post-copy); None: local
    images: str                 # the directory the lazy-pages daemon works in
    started: float = Field(default_factory=time.time)
    seconds: float | None = None  # from the lazy-pages daemon's start (before the restore) to the end
    ended: float | None = None    # when it ended (wall clock): where the job's pause ends (coordinator/ledger.py)
    reason: str | None = None   # why it failed, or how its end was learnt


class WorkerReport(BaseModel):
    # An agent of another release may say more: what this one does not know is kept, not refused.
    model_config = ConfigDict(extra="allow")

    id: str
    job: str
    rank: int
    root_pid: int
    start_time: int
    state: WorkerState = "running"
    restored: bool = False                # restored here by this agent (its output pumped by us)
    moved_to: dict[str, str] | None = None  # {"agent": name, "url": url}
    exit_code: int | None = None
    reason: str | None = None             # why it is lost, where pitstop knows
    output_base: dict[str, int] = Field(default_factory=dict)  # output seen before it arrived here
    net: dict[str, str] | None = None     # network.workerns.WorkerNet: an address that moves with it
    # What a restore must grant it (proc/caps.py, hex), as of the last listing: the coordinator
    # refuses, before anything pauses, a destination whose agent could not.
    caps: str | None = None
    fill: Fill | None = None              # a post-copy restore's fill, while and after it runs
    keeper: dict[str, int] | None = None  # holds its pidfd for an agent that restarts (agent/exitkeeper.py)
    unmovable: str | None = None          # why it cannot be moved, as its NCCL shim knows (shimctl.unmovable)
    owner_uid: int | None = None          # who registered it on the local socket: only they (or root) may end it
    init_dir: str | None = None           # where its namespace's init works (nsinit.py): made again where it is restored
    # The `pitstop run` that registered it here ({"pid", "start"}): its end ends the worker while
    # the worker runs here (agent/handles.py).  None: registered over TCP, or restored here.
    launcher: dict[str, int] | None = None
    world: int | None = None              # the job's number of ranks, as its launcher was told (WORLD_SIZE, SLURM_NTASKS)
    slurm_job: str | None = None          # the Slurm job whose task started it (SLURM_JOB_ID): travels with it
    # Wall clock of its last stop for a peer's move (SIGSTOP) and of its running again (SIGCONT, or
    # its restore here): the pause this rank saw, for the coordinator's ledger.
    paused_at: float | None = None
    running_since: float | None = None
    # A pause asked with a deadline (wall clock): past it, with nobody having resumed the worker,
    # its agent resumes it (the coordinator that paused it died; Agent.resume_overdue)
    pause_until: float | None = None
    registered_at: float = Field(default_factory=time.time)
    # `pitstop run --snapshot-every`: how often the job would like a snapshot (the coordinator takes
    # the smallest its ranks ask); travels with the worker through moves and recoveries
    snapshot_every_s: float | None = None
    fenced_epoch: int | None = None  # its job was recovered elsewhere while this host was away: ended here for good
    # When it ended (its launcher's clock, else when this agent found it gone), and whether that end
    # was asked for (a signal its launcher forwarded, `pitstop stop|kill`): the coordinator tells a
    # host whose ranks all failed at once from a job that ended (coordinator/recovery.py)
    ended_at: float | None = None
    end_asked: bool = False
    # The job's committed snapshot, as the coordinator last said (its drop of older ones): its NCCL
    # shim parks the rank on a peer's failure instead of letting the error end it, and the job's
    # recovery rolls it back (shim/ctl.h `protect`).  None: no snapshot covers the job, as far as known.
    protected_by: int | None = None
    peer_lost: str | None = None  # its shim holds back a communicator error for the recovery (shimctl.peer_lost)
    # The container it is (agent/containers.py): its root is the container's init, and the container
    # runtime checkpoints and restores it.  None: a worker on the host.
    container: dict[str, Any] | None = None

"""What an agent knows and must not forget: its workers and its captures.

Kept in memory, written through to <state_dir>/agent-state.json on every
change (atomically), so that a restarted agent still knows which sources it
left stopped and where moved workers went.

What has ended is forgotten in time (AgentState.prune): every change rewrites the whole
file, several times inside a move's pause, and an agent that keeps every capture it ever
made pays for its history in every later pause (38 ms a write after 1,000 moves, 208 ms
after 5,000, against 2-3 ms with this: bench/state_write.py, 2-core test VM, 2026-12-02).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, Field

from pitstop.agent.timeouts import ENDED_WORKER_UNREAD_S
from pitstop.errors import Conflict, FailedPrecondition, NotFound
from pitstop.proc import proctree
from pitstop.wire.capture_report import CaptureReport, CaptureState  # noqa: F401 - CaptureState re-exported

WorkerState = Literal["running", "paused", "capturing", "stopped", "released", "moved", "exited", "lost"]
LIVE_STATES = ("running", "paused", "capturing", "stopped")  # a process exists for these
ENDED_WORKERS = ("moved", "exited", "lost")  # nothing runs here: kept only to be asked about
ENDED_CAPTURES = ("committed", "rolled_back", "failed")  # nothing more can be done with these
KEEP_ENDED = 64  # ended captures, and ended workers, kept whatever their age (inspection, retried calls)
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


class Worker(BaseModel):
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


class Capture(CaptureReport):
    """The agent's record of a capture: the report peers see (wire/capture_report.py), and what only
    this agent needs to finish or undo it."""

    image_dir: str
    run_id: str = ""
    stdio: list[dict[str, Any]] = Field(default_factory=list)
    keep_peers: list[str] | None = None  # addresses whose connections survive the move; None: all
    want_post_copy: bool | None = None  # network post-copy, as settled when the capture began
    # the dump's files as CRIU left them (criu/seal.py), checked before a rollback restores them
    seal: dict[str, list] | None = None
    rollback_failed_at: float | None = None  # when a rollback first failed: its images expire after a while


class AgentState:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "agent-state.json"
        self.lock = threading.RLock()
        self.workers: dict[str, Worker] = {}
        self.captures: dict[str, Capture] = {}
        self._last_read: dict[str, float] = {}
        self._loaded = time.monotonic()  # what a restarted agent loads counts as read now
        self.on_forget: Callable[[Worker], None] = lambda w: None  # the agent removes its output files
        if self.path.exists():
            raw = json.loads(self.path.read_text())
            self.workers = {k: Worker(**v) for k, v in raw.get("workers", {}).items()}
            self.captures = {k: Capture(**v) for k, v in raw.get("captures", {}).items()}

    def read(self, wid: str) -> None:
        """Someone (a launcher following its worker) read this worker's output: keep it."""
        self._last_read[wid] = time.monotonic()

    def prune(self) -> None:
        """Forget ended captures beyond the newest KEEP_ENDED, and ended workers beyond the newest
        KEEP_ENDED that nobody has read for ENDED_WORKER_UNREAD_S (each handed to on_forget)."""
        with self.lock:
            ended = sorted((c for c in self.captures.values() if c.state in ENDED_CAPTURES), key=lambda c: c.updated)
            for c in ended[:max(0, len(ended) - KEEP_ENDED)]:
                del self.captures[c.id]
            now = time.monotonic()
            done = sorted((w for w in self.workers.values() if w.state in ENDED_WORKERS),
                          key=lambda w: w.registered_at)
            workers = [w for w in done[:max(0, len(done) - KEEP_ENDED)]
                       if now - self._last_read.get(w.id, self._loaded) > ENDED_WORKER_UNREAD_S]
            for w in workers:
                del self.workers[w.id]
                self._last_read.pop(w.id, None)
                self.on_forget(w)

    def save(self) -> None:
        with self.lock:
            if len(self.captures) + len(self.workers) > 2 * KEEP_ENDED:
                self.prune()
            data = {"workers": {k: v.model_dump() for k, v in self.workers.items()},
                    "captures": {k: v.model_dump() for k, v in self.captures.items()}}
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)

    def worker(self, wid: str) -> Worker:
        w = self.workers.get(wid)
        if w is None:
            raise NotFound(f"no worker {wid!r} is registered on this agent",
                           action="list workers with GET /v1/workers; only workers started "
                                  "through `pitstop run` can be captured")
        return w

    def capturable(self, wid: str) -> Worker:
        """The worker, if a capture or a pre-copy may begin now: running, and still the process
        it was registered as (one found gone is marked lost).  Called with the lock held."""
        w = self.worker(wid)
        if w.state != "running":
            raise Conflict(f"worker {w.id} is {w.state}, not running", code="worker_not_running",
                           action="wait for the operation that holds it to finish")
        if not proctree.is_running(w.root_pid, w.start_time):
            self.update_worker(w, state="lost")
            raise FailedPrecondition(f"worker {w.id} (pid {w.root_pid}) is no longer running",
                                     code="worker_gone", action="nothing to capture; the worker exited")
        return w

    def capture(self, cid: str) -> Capture:
        c = self.captures.get(cid)
        if c is None:
            raise NotFound(f"no capture {cid!r} on this agent", action="list captures with GET /v1/captures")
        return c

    def update_capture(self, c: Capture, **changes: Any) -> None:
        with self.lock:
            for k, v in changes.items():
                setattr(c, k, v)
            c.updated = time.time()
            self.save()

    def end_fill(self, w: Worker, state: str, seconds: float | None = None, reason: str | None = None) -> None:
        """Record how the worker's lazy fill ended (filled, failed, unknown), and after how long."""
        if w.fill is not None:
            self.update_worker(w, fill=w.fill.model_copy(update={
                "state": state, "reason": reason, "ended": round(time.time(), 3),
                "seconds": round(seconds if seconds is not None else time.time() - w.fill.started, 3)}))

    def update_worker(self, w: Worker, **changes: Any) -> None:
        with self.lock:
            for k, v in changes.items():
                setattr(w, k, v)
            self.save()

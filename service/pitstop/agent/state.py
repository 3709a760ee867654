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
from typing import Any, Callable

from pydantic import ConfigDict, Field

from pitstop.agent.timeouts import ENDED_WORKER_UNREAD_S
from pitstop.errors import Conflict, FailedPrecondition, NotFound
from pitstop.proc import proctree
from pitstop.wire.capture_report import CaptureReport, CaptureState  # noqa: F401 - CaptureState re-exported
from pitstop.wire.worker_report import Fill, FillState, WorkerReport, WorkerState  # noqa: F401 - re-exported

LIVE_STATES = ("running", "paused", "capturing", "stopped")  # a process exists for these
ENDED_WORKERS = ("moved", "exited", "lost")  # nothing runs here: kept only to be asked about
ENDED_CAPTURES = ("committed", "rolled_back", "failed")  # nothing more can be done with these
KEEP_ENDED = 64  # ended captures, and ended workers, kept whatever their age (inspection, retried calls)


class Worker(WorkerReport):
    """The agent's record of a worker: the report peers see (wire/worker_report.py), whole.  Read
    back from the agent's state file, a key this release does not know is dropped."""

    model_config = ConfigDict(extra="ignore")


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

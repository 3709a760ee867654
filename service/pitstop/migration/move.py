"""Move one worker from a source agent to a destination agent, by the coordinator's own driver.

Tests and benchmarks move a single worker between two agents without a running coordinator.
They do it with the same code an evacuation runs (coordinator/driver.py, evacuation_run.py): a one-worker plan,
driven over a throwaway store in this process, through the same phases (check the files,
settle the plan, pause the job's other workers, capture, verify, release, restore, commit,
resume, clean the source) and the same way back.  So there is one step order and one rollback
in pitstop, and every test that moves a worker exercises them.

What differs from an evacuation, by design: the worker is named rather than its host emptied,
nothing is pre-copied unless asked, and the move returns once the worker runs at the destination
rather than waiting for a network post-copy's fill to end (a test may want to watch the fill).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from pitstop.coordinator.driver import Driver
from pitstop.coordinator.planner import Plan
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.sqlitestore import Store
from pitstop.errors import DeadlineExceeded, PitstopError
from pitstop.wire.agent_client import AgentClient
from pitstop.wire.evacuation import EvacuationState
from pitstop.wire.store_rows import StoredHost, StoredWorker
from pitstop.wire.worker_report import WorkerReport

log = structlog.get_logger("pitstop.move")

MOVE_SLACK_S = 120.0  # beyond the capture's deadline: verify, restore, commit and the resume


@dataclass
class MoveReport:
    worker_id: str
    capture_id: str
    source: str
    destination: str
    phases: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    downtime_s: float = 0.0  # from the first pause to the last resume, as the job saw it
    restored_pid: int | None = None


def move_worker(src: AgentClient, dst: AgentClient, worker_id: str, *, dest_name: str = "",
                capture_deadline_s: float = 300.0, peers: Sequence[tuple[AgentClient, str]] = (),
                post_copy: bool = False, pre_copy: bool = False) -> MoveReport:
    """Run the whole move; raise PitstopError (the worker still running where it was) on failure.

    post_copy: network post-copy for this move (refused before anything pauses where the source
    cannot serve it).
    peers: the job's other workers (agent, worker id), paused for the move as an evacuation
    pauses them: nothing is sent into the worker's connections while it is dumped.
    dest_name: the destination's name, as the source records where the worker went (default:
    the name the destination agent gives itself).
    """
    with tempfile.TemporaryDirectory(prefix="pitstop-move-") as tmp:
        store = Store(Path(tmp) / "move.db")
        try:
            return _move(store, Path(tmp), src, dst, worker_id, dest_name, capture_deadline_s, peers,
                         post_copy, pre_copy)
        finally:
            store.close()  # under its lock: a fill thread of this move may still be saving


def _move(store: Store, tmp: Path, src: AgentClient, dst: AgentClient, worker_id: str, dest_name: str,
          capture_deadline_s: float, peers: Sequence[tuple[AgentClient, str]], post_copy: bool,
          pre_copy: bool) -> MoveReport:
    names: dict[str, str] = {}  # agent URL -> the name it is known by in this move
    for c, name in ((src, None), (dst, dest_name or None), *((p, None) for p, _ in peers)):
        if c.url not in names:
            names[c.url] = name or c.info()["name"]
            store.heartbeat({"name": names[c.url], "url": c.url, "spare": c is dst,
                             "workers": [_report(w) for w in c.workers()]})
    w = src.worker(worker_id)
    node, dest = names[src.url], names[dst.url]
    plan = Plan(node=_stored(store.host(node), node), dest=_stored(store.host(dest), dest), jobs=[w.job],
                leaving=[StoredWorker(id=worker_id, job=w.job, rank=w.rank, host=node, state=w.state,
                                      updated=time.time())],
                peers=[StoredWorker(id=wid, job=w.job, rank=-1, host=names[p.url], state="running", updated=time.time())
                       for p, wid in peers])  # a peer's id and host are all the move reads of it
    settings = CoordinatorSettings(db=tmp / "move.db", cluster_token=src.token, pre_copy=pre_copy,
                                   capture_deadline_s=capture_deadline_s)
    driver = Driver(store, settings, await_fills=False)
    op_id = driver.start(plan, "one-worker move", None, post_copy=post_copy)
    t = driver.ops.threads[op_id]
    t.join(capture_deadline_s + MOVE_SLACK_S)
    if t.is_alive():
        raise DeadlineExceeded(f"the move of {worker_id} did not end within {capture_deadline_s + MOVE_SLACK_S:.0f} s",
                               action="the driver goes on in the background; see the agents' logs")
    op = store.op(op_id)
    assert op is not None
    md = EvacuationState.load(op.metadata)
    if not op.done:  # its thread ended without ending it; no watchdog here to drive it out
        run = driver.ops.runs.get(op_id)
        raise PitstopError(f"the move of {worker_id} stopped in phase {md.phase!r}: "
                           f"{run.crash if run else 'no word'}", action="see the agents' logs")
    if op.result != "succeeded":
        raise _error(op.error or {})
    wp = md.workers[worker_id]
    seconds = {**wp.capture_phases, "verify": md.phases.get("verify", 0.0),
               **{k: v for k, v in wp.restore_phases.items() if k != "verify"},
               "restore_call": md.phases.get("restore", 0.0)}
    # the agents' phases also carry counts (bytes, threads, rounds): a report of seconds leaves them out
    phases = {k: v for k, v in seconds.items() if not k.endswith(("_bytes", "_threads", "_rounds", "_processes",
                                                                   "_attempts", "_failed"))}
    report = MoveReport(worker_id, wp.capture_id or "", src.url, dst.url, phases=phases, bytes=wp.bytes_total or 0,
                        downtime_s=md.downtime_s or 0.0, restored_pid=wp.restored_pid)
    log.info("moved", worker=worker_id, src=src.url, dst=dst.url, downtime_s=round(report.downtime_s, 3),
             bytes=report.bytes, **{k: round(v, 4) for k, v in phases.items()})
    return report


def _stored(h: StoredHost | None, name: str) -> StoredHost:
    if h is None:  # each agent's report was written just above
        raise PitstopError(f"{name}'s report was not recorded", action="see the agents' logs")
    return h


def _report(w: WorkerReport) -> dict[str, Any]:
    return w.model_dump(include={"id", "job", "rank", "state", "caps"})


def _error(status: dict[str, Any]) -> PitstopError:
    """The operation's error (google.rpc.Status-shaped) as the PitstopError it began as."""
    info = (status.get("details") or [{}])[0]
    return PitstopError.from_dict({"code": info.get("reason", "internal"), "message": status.get("message", ""),
                                   "action": info.get("action", ""), "details": info.get("metadata") or {}},
                                  http_status=_HTTP.get(status.get("status", ""), 500))


_HTTP = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "ABORTED": 409, "CANCELLED": 409, "DEADLINE_EXCEEDED": 504,
         "UNAVAILABLE": 503, "DATA_LOSS": 422, "FAILED_PRECONDITION": 412, "INTERNAL": 500}


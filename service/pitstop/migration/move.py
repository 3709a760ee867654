"""Move one worker from a source agent to a destination agent.

The order of steps is the safety argument:
 1. capture on the source, streamed to the destination while dumping; the
    source is left stopped.  Failure: the source agent resumes it by itself.
 3. verify the copy at rest on the destination (sizes, digests).  Failure:
    the copy is discarded and the stopped source resumed in place.
 4. release: the stopped source is killed, its images kept (same-network TCP
    restore needs the four-tuples free, see agent/capturing.py).
 5. restore on the destination.
    Failure: roll back, i.e. the source agent restores its own images.
 6. commit on the source: lock lifted, images deleted, worker marked moved.
Until step 6 returns, every failure leaves the worker running where it was.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from pitstop.errors import PitstopError
from pitstop.wire.agent_client import AgentClient

log = structlog.get_logger("pitstop.move")


@dataclass
class MoveReport:
    worker_id: str
    capture_id: str
    source: str
    destination: str
    phases: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    downtime_s: float = 0.0
    restored_pid: int | None = None


def move_worker(src: AgentClient, dst: AgentClient, worker_id: str, *, dest_name: str = "",
                capture_deadline_s: float = 300.0,
                on_progress: Callable[[dict[str, Any]], None] | None = None,
                fault: Callable[[str], None] | None = None,
                peers: Sequence[tuple[AgentClient, str]] = (), post_copy: bool | None = None) -> MoveReport:
    """Run the whole move; raise PitstopError (worker still running somewhere) on failure.

    post_copy: network post-copy for this move (None: the source agent's setting).

    peers: the job's other workers (agent, worker id), paused (SIGSTOP) for the duration, as
    the coordinator does: nothing is sent into the worker's connections while it is dumped.
    """
    for a, wid in peers:
        a.pause(wid)
    try:
        return _move(src, dst, worker_id, dest_name, capture_deadline_s, on_progress, fault, post_copy)
    finally:
        for a, wid in peers:
            _quiet(a.resume, wid)


def _move(src: AgentClient, dst: AgentClient, worker_id: str, dest_name: str, capture_deadline_s: float,
          on_progress: Callable[[dict[str, Any]], None] | None,
          fault: Callable[[str], None] | None, post_copy: bool | None = None) -> MoveReport:
    image_id = "img-" + uuid.uuid4().hex[:12]
    t0 = time.monotonic()
    cap = src.capture(worker_id, dest_url=dst.url, image_id=image_id, post_copy=post_copy)
    cap = src.wait_capture(cap["id"], capture_deadline_s, on_progress)
    if cap["state"] == "failed":
        _quiet(dst.discard, image_id)
        e = cap["error"] or {}
        raise PitstopError.from_dict(e)
    report = MoveReport(worker_id, cap["id"], src.url, dst.url, bytes=cap.get("bytes_total") or 0)
    report.phases.update({k: v for k, v in cap["phases"].items()})
    if fault:
        fault("before_verify")
    try:
        v = dst.verify(image_id)
    except PitstopError:
        _quiet(dst.discard, image_id)
        src.rollback(cap["id"])  # still stopped: resumed in place
        raise
    report.phases["verify"] = v["seconds"]
    if fault:
        fault("before_release")
    src.release(cap["id"])
    t_restore = time.monotonic()
    try:
        if fault:
            fault("before_restore")
        r = dst.restore(image_id)
    except PitstopError as e:
        log.warning("restore failed; rolling back to the source", worker=worker_id, error=str(e))
        _quiet(dst.discard, image_id)
        src.rollback(cap["id"])
        raise
    report.phases.update({k: v for k, v in r["phases"].items() if k != "verify"})
    report.phases["restore_call"] = time.monotonic() - t_restore
    report.restored_pid = r["worker"]["root_pid"]
    src.commit(cap["id"], {"agent": dest_name or dst.url, "url": dst.url})
    report.downtime_s = time.monotonic() - t0
    log.info("moved", worker=worker_id, src=src.url, dst=dst.url, downtime_s=round(report.downtime_s, 3),
             bytes=report.bytes, **{k: round(v, 4) for k, v in report.phases.items()})
    return report


def _quiet(fn: Callable[..., Any], *a: Any) -> None:
    try:
        fn(*a)
    except PitstopError:
        pass

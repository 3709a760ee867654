"""The ledger: every finished move, as one flat entry an operator can query, chart and export.

Built from the operations' own records (the evacuation's typed state), so that nothing is written
twice: why the move happened, what was decided, the bytes moved before, during and after the
pause, each phase, the pause the job saw, and what the job did once it ran again (its time to
useful progress, coordinator/progress.py).
"""

from __future__ import annotations

from typing import Any

from pitstop.wire.evacuation import EvacuationState, PauseEnd
from pitstop.wire.recovery_state import TYPE_URL as RECOVERY_TYPE_URL
from pitstop.wire.store_rows import StoredOp


def entry(op: StoredOp) -> dict[str, Any]:
    """A finished operation's ledger entry: an evacuation's, or a recovery's (kind says which)."""
    if op.metadata.get("@type") == RECOVERY_TYPE_URL:
        return recovery_entry(op)
    md = EvacuationState.load(op.metadata)
    planned = next((c for c in md.conditions if c.type == "Planned"), None)
    after = md.after_move.model_dump(exclude_none=True) if md.after_move else None
    spread = (md.pause_round_s or 0.0) + md.phases.get("resume", 0.0)
    pause, until = job_pause(md)
    return {
        "operation": f"operations/{op.id}",
        "kind": "evacuation",
        "result": op.result,
        "created": op.created,
        "finished": op.updated,
        "why": {"reason": md.reason, "requested_by": md.requested_by},
        "decision": {"node": md.node, "destination": md.destination,
                     "planned": planned.message if planned else None,
                     "plan": md.plan.model_dump() if md.plan else None},
        "jobs": md.jobs,
        "leaving": sorted(md.workers),
        "peers": len(md.peers),
        "bytes": {"before_pause": md.pre_copy_bytes or 0, "during_pause": md.bytes_total,
                  "after_resume": md.bytes_after_resume or 0},
        "phases": md.phases,
        # The pause the job saw (job_pause): every rank of the jobs is paused from the first pause
        # to the last resume, give or take how long the pause and the resume rounds took to go round
        # them all (the spread); after a post-copy restore, until its first step or the fill's end.
        "pause_s": pause,
        "pause_until": until,
        "downtime_s": md.downtime_s,
        "pause_spread_s": round(spread, 4) if md.downtime_s is not None else None,
        # ... and as each rank saw it, where its shim kept the times (NCCL jobs)
        "rank_pause_s": md.after_move.rank_pause_s if md.after_move else None,
        "after_move": after,
        "error": op.error,
    }


def job_pause(md: EvacuationState) -> tuple[float | None, PauseEnd]:
    """The pause the job saw, in seconds from the first pause, and what ended it.

    Until the last resume (the downtime), except after a post-copy restore (network post-copy, or
    lazily from the destination's own copy): its ranks run again on memory still being filled,
    and every page they touch first waits on the fill.  Measured on a job with DataLoader workers,
    the downtime said 0.89-1.40 s while the job's largest gap between two steps was 1.45-2.50 s
    (bench/results/2026-12-06-compare-workers.md).  So there the pause lasts until the later of the
    job's first step after the move (NCCL jobs: every rank did a step's work, after_move.first_step_s
    from the last resume) and the end of the moved workers' fills (as their agents' clocks said);
    a gloo job shows no step, so the fill's end alone.  What is not known yet (a fill
    still going, the watch of the job not done) is left out until it is."""
    if md.downtime_s is None or md.first_pause is None or md.last_resume is None:
        return md.downtime_s, "last resume"
    lazy = [w for w in md.workers.values() if w.bytes_after_resume or "fill_start" in w.restore_phases]
    if not lazy:
        return md.downtime_s, "last resume"
    ends: dict[PauseEnd, float] = {}
    filled = [t for t in (_fill_end(w.fill) for w in lazy if w.fill) if t is not None]
    if filled and len(filled) == len(lazy):
        ends["fill end"] = max(filled)
    if md.after_move is not None and md.after_move.first_step_s is not None:
        ends["first step"] = md.last_resume + md.after_move.first_step_s
    until = max(ends, key=ends.__getitem__, default=None)
    if until is None or ends[until] <= md.last_resume:
        return md.downtime_s, "last resume"
    return round(ends[until] - md.first_pause, 4), until


def _fill_end(fill: dict[str, Any]) -> float | None:
    """When a fill ended, by its agent's clock; None while it runs.  An agent that does not say
    (`ended` is newer) gives its start and length: its length counts from the daemon's start,
    before the restore, so that end is late by the restore's time."""
    if fill.get("ended") is not None:
        return float(fill["ended"])
    if fill.get("started") is not None and fill.get("seconds") is not None:
        return float(fill["started"]) + float(fill["seconds"])
    return None


def recovery_entry(op: StoredOp) -> dict[str, Any]:
    """A recovery in the ledger's shape: what failed and how it was found, the snapshot the job went
    back to, the pause, the work redone, the spare it took and the spares left after it."""
    md = op.metadata
    sent = sum(int(r.get("bytes", 0)) for r in (md.get("replicas_sent") or {}).values())
    return {
        "operation": f"operations/{op.id}",
        "kind": "recovery",
        "result": op.result,
        "created": op.created,
        "finished": op.updated,
        "why": {"reason": md.get("cause") or md.get("requested_by"), "requested_by": md.get("requested_by")},
        "decision": {"node": md.get("node"), "destination": md.get("destination"), "planned": None, "plan": None},
        "jobs": [md.get("job")],
        "leaving": sorted(md.get("restored") or {}),
        "peers": 0,
        "bytes": {"before_pause": 0, "during_pause": sent, "after_resume": 0},
        "phases": md.get("phases") or {},
        "pause_s": md.get("pause_s"),
        "pause_until": "last resume",
        "downtime_s": md.get("pause_s"),
        "pause_spread_s": None,
        "rank_pause_s": None,
        "after_move": None,
        "recovery": {"detected_after_s": md.get("detected_after_s"), "snapshot": md.get("snapshot"),
                     "snapshot_age_s": md.get("snapshot_age_s"), "lost_ranks": md.get("lost_ranks"),
                     "work_redone_s": md.get("lost_s"), "steps_redone": md.get("steps_redone"),
                     "spares_failed": md.get("spares_failed") or [], "spares_left": md.get("spares_left")},
        "error": op.error,
    }


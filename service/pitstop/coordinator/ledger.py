"""The ledger: every finished move, as one flat entry an operator can query, chart and export.

Built from the operations' own records (the evacuation's typed state), so that nothing is written
twice: why the move happened, what was decided, the bytes moved before, during and after the
pause, each phase, the pause the job saw, and what the job did once it ran again (its time to
useful progress, coordinator/progress.py).
"""

from __future__ import annotations

from typing import Any

from pitstop.wire.evacuation import EvacuationState


def entry(op: dict[str, Any]) -> dict[str, Any]:
    md = EvacuationState.load(op["metadata"])
    planned = next((c for c in md.conditions if c.type == "Planned"), None)
    after = md.after_move.model_dump(exclude_none=True) if md.after_move else None
    spread = (md.pause_round_s or 0.0) + md.phases.get("resume", 0.0)
    return {
        "operation": f"operations/{op['id']}",
        "result": op["result"],
        "created": op["created"],
        "finished": op["updated"],
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
        # Every rank of the jobs is paused from the first pause to the last resume, give or take
        # how long the pause and the resume rounds took to go round them all.
        "pause_s": md.downtime_s,
        "pause_spread_s": round(spread, 4) if md.downtime_s is not None else None,
        # ... and as each rank saw it, where its shim kept the times (NCCL jobs)
        "rank_pause_s": md.after_move.rank_pause_s if md.after_move else None,
        "after_move": after,
        "error": op.get("error"),
    }

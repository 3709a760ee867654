"""The time to useful progress after a move, measured from what the job does, not from the pause.

The papers pitstop is measured against count recovery until the job makes progress again, not
until its processes run.  Without changing the job, the one place its progress shows is its
NCCL calls: the NCCL shim counts, per communicator, the collectives each rank issued and its sends
and receives to each peer, and keeps those counters across the move.  "Collectives" below counts
all three alike (a pipeline's stages only send and receive).  At the consistent cut every rank's count is known exactly; after
the last resume the coordinator reads them again every few milliseconds for a while:

- `first_collectives_s`: until every rank has issued two collectives since the cut, so that its
  first one after the move has returned (a collective that returns before the next one is called,
  as on a CPU or in a job that waits on its results; a GPU launch alone returns at once, and then
  this bounds the first launch only).
- `back_to_speed_s`: until the job's collective rate over the trailing second is back to 90 % of
  its rate before the move (the rate between the operation's start and the cut, where that window
  held at least 5 collectives a rank).
- `step_time_ratio`: the rate before over the rate after: the same job's steps hold the same
  collectives, so this is how much longer a step takes on its new hosts (a slower spare shows).
- `first_step_s`: until every rank has done a whole step's work after the move.  The shim signs
  each operation (call, communicator, peer, count, type) into a trail of the last 256; a training
  step repeats the same run of them, so the shortest period of the trail's end, read before the
  move, is the rank's operations per step K.  A rank has done a step's work once it has issued K + 1
  operations since the cut: the K intervals between them are every gap of the step once (its
  forward pass and optimizer included), and the last of the K has returned.  The cut may fall
  anywhere inside a step, so this is one step's length of work, not the step the job counts.
  None where no period shows (a trail with no repeat in its last 3 periods, or a shim without one).
- Both are timed twice: by the watcher's reads (as fine as an agent round trip, tens of ms) and
  by the shim, which stamps each operation's issue time into the trail beside its signature; the
  shim's times replace the reads' where every rank's are known (`timed_by`), counted from the last
  rank's resume as its shim stamped it (the coordinator hears of the resume a round trip after
  the ranks run again).  Wall clocks: a moved rank's times are its new host's, good to the hosts'
  clock sync.
- `rank_pause_s`: the pause each rank saw, as its own shim wrote it: from parking at the cut to
  leaving it (wall clock: a moved rank parks on one host and leaves on another).  In a job paused
  with SIGSTOP, as its agents timed it instead (pauses_between): a peer from its SIGSTOP to its
  SIGCONT, a leaving rank from its capture stopping it to its restore running it on the spare.

A job without the shim's communicators (gloo) shows no progress the coordinator can see without
a change to it: `measured` is false, with why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from pitstop.coordinator.cut import block_ops
from pitstop.wire.evacuation import AfterMove

log = structlog.get_logger("pitstop.progress")

BACK_TO_SPEED = 0.9
RATE_WINDOW_S = 1.0
MIN_BEFORE_S = 0.1        # a rate before the move needs a window at least this long
MIN_BEFORE_COLLECTIVES = 5  # ... holding at least this many collectives a rank
MIN_AFTER_S = 0.5


@dataclass(frozen=True)
class Sample:
    at: float                  # time.time()
    issued: dict[str, int]     # per worker
    per_step: dict[str, int] | None = None  # per worker, its operations per step (from the trail)


MIN_REPEATS = 3  # a period counts once the trail's end repeats it this many times


def ops_per_step(trail: list[int], min_repeats: int = MIN_REPEATS) -> int | None:
    """The shortest period of the trail's end, seen `min_repeats` times over; None where none is."""
    n = len(trail)
    for k in range(1, n // min_repeats + 1):
        tail = trail[n - k * min_repeats:]
        if all(tail[i] == tail[i + k] for i in range(len(tail) - k)):
            return k
    return None


def per_step_by_worker(blocks: dict[str, list[dict]]) -> dict[str, int]:
    """Each worker's operations per step: the sum over its processes' blocks (each counts its own),
    for the workers where every block that issued anything shows a period."""
    out: dict[str, int] = {}
    for w, bs in blocks.items():
        ks = [ops_per_step(b["trail"]) if b.get("trail") else None for b in bs if b.get("trail") or block_ops(b)]
        if ks and all(k is not None for k in ks):
            out[w] = sum(k for k in ks if k is not None)
    return out


TORN = 16  # the trail's oldest entries may be overwritten while it is read: not trusted


def _issued_at(b: dict, index: int) -> float | None:
    """When the block's process issued its operation number `index` (0-based), where its trail
    still holds it."""
    at, n = b.get("trail_at"), b.get("trail_n", 0)
    if not at or not index < n:
        return None
    first = n - len(at)  # > 0: the ring has wrapped, and its oldest entries are the torn ones
    return at[index - first] if index >= first + (TORN if first else 0) else None


def op_times(blocks: dict[str, list[dict]], cut: Sample, per_step: dict[str, int] | None) -> dict[str, tuple]:
    """From the shims' own clocks, per worker: when its second operation after the cut was issued
    (its first had returned), and when its (K+1)-th was (a step's work done; None without K).
    Only workers with one NCCL process (its trail counts all they issued) and whose trail still
    holds those operations."""
    out: dict[str, tuple] = {}
    for w, bs in blocks.items():
        live = [b for b in bs if b.get("trail_n")]
        if len(live) != 1 or w not in cut.issued:
            continue
        base = cut.issued[w]
        second = _issued_at(live[0], base + 1)
        k = (per_step or {}).get(w)
        step = _issued_at(live[0], base + k) if k else None
        if second is not None and (step is not None or not k):
            out[w] = (second, step)
    return out


def pauses_between(stopped: dict[str, float], running: dict[str, float]) -> dict[str, float]:
    """The pause each worker saw where its agents timed it: stopped (SIGSTOP, or its capture
    stopping it) to running again (SIGCONT, or its restore).  Wall clocks of two hosts for a moved
    rank, good to their clock sync."""
    return {w: round(running[w] - t, 4) for w, t in stopped.items() if w in running and running[w] >= t}


def last_resume(blocks: dict[str, list[dict]]) -> float | None:
    """When the last rank left its park, by its own shim; None unless every worker's shim says."""
    got = [max((b["pause"]["resumed"] or 0.0 for b in bs if b.get("pause")), default=0.0) for bs in blocks.values()]
    return max(got) if got and all(got) else None


def with_op_times(after: AfterMove, times: dict[str, tuple], resumed_at: float | None) -> AfterMove:
    """The watch's figures, timed by the ranks' shims instead of by its reads where every rank's are
    known: exact to the operation, where the reads are only as fine as their round trips.
    resumed_at: the last rank's resume by its own shim (last_resume), not the coordinator's clock,
    which learns of the resume a round trip after the ranks run."""
    if not after.measured or after.ranks is None or len(times) != after.ranks or resumed_at is None:
        return after
    first = max(t[0] for t in times.values())
    update: dict = {"first_collectives_s": round(first - resumed_at, 4), "first_collectives_at": round(first, 6),
                    "timed_by": "shim"}
    if after.ops_per_step and all(t[1] is not None for t in times.values()):
        update["first_step_s"] = round(max(t[1] for t in times.values()) - resumed_at, 4)
    return after.model_copy(update=update)


def rank_pauses(blocks: dict[str, list[dict]]) -> dict[str, float]:
    """The pause each worker saw at the last cut, from its shims' own times: its first process's
    park to its last one's resume.  Workers still parked, or whose shim keeps no times, are left out."""
    out: dict[str, float] = {}
    for w, bs in blocks.items():
        ps = [b["pause"] for b in bs if b.get("pause")]
        if ps and all(p["resumed"] is not None for p in ps):
            out[w] = round(max(p["resumed"] for p in ps) - min(p["parked"] for p in ps), 4)
    return out


def rate(a: Sample, b: Sample) -> float | None:
    """Collectives per rank per second between two samples of the same workers."""
    dt = b.at - a.at
    ws = [w for w in b.issued if w in a.issued]
    if dt <= 0 or not ws:
        return None
    return sum(b.issued[w] - a.issued[w] for w in ws) / len(ws) / dt


def not_measured(why: str) -> AfterMove:
    return AfterMove(measured=False, why_not=why)


def watch(read: Callable[[], dict[str, int]], cut: Sample, resumed_at: float, before: Sample | None,
          window_s: float = 10.0, every_s: float = 0.01, now: Callable[[], float] = time.time,
          sleep: Callable[[float], None] = time.sleep) -> AfterMove:
    """Read the workers' counts (`read`) from the resume for `window_s`, and say what they show.

    cut: each worker's count at the consistent cut; before: a sample taken earlier while the job
    ran (its rate before the move), or None."""
    ranks = sorted(cut.issued)
    rate_before = rate(before, cut) if before and cut.at - before.at >= MIN_BEFORE_S else None
    if rate_before is not None and before is not None and rate_before * (cut.at - before.at) < MIN_BEFORE_COLLECTIVES:
        rate_before = None  # too few collectives between the samples to be a rate
    second: dict[str, float] = {}
    stepped: dict[str, float] = {}
    per_step = {w: k for w, k in (before.per_step or {}).items() if w in cut.issued} if before else {}
    if set(per_step) != set(ranks):
        per_step = {}  # a step is the whole job's: measured for all its ranks or not at all
    history: list[Sample] = []
    back: float | None = None
    end = resumed_at + window_s
    while True:
        t = now()
        try:
            got = read()
        except Exception as e:  # noqa: BLE001 - an agent that does not answer now may answer the next read
            log.debug("a read of the job's collective counts failed", error=repr(e))
            got = {}
        if got:
            s = Sample(t, got)
            history.append(s)
            for w in ranks:
                if w not in second and got.get(w, 0) - cut.issued[w] >= 2:
                    second[w] = t
                if w in per_step and w not in stepped and got.get(w, 0) - cut.issued[w] >= per_step[w] + 1:
                    stepped[w] = t
            if rate_before and back is None and len(second) == len(ranks):
                past = [h for h in history if h.at <= t - RATE_WINDOW_S and h.at >= resumed_at]
                r = rate(past[-1], s) if past else None
                if r is not None and r >= BACK_TO_SPEED * rate_before:
                    back = t - resumed_at
        done_early = (back is not None and len(second) == len(ranks) and len(stepped) == len(per_step)
                      and t - resumed_at >= 3 * RATE_WINDOW_S)
        if t >= end or done_early:
            break
        sleep(every_s)
    first = max(second.values()) - resumed_at if len(second) == len(ranks) else None
    after = None
    if first is not None:
        start = next((h for h in history if h.at >= resumed_at + first), None)
        if start is not None and history[-1].at - start.at >= MIN_AFTER_S:
            after = rate(start, history[-1])
    why = None if first is not None else (
        f"not every rank issued two collectives within {window_s:g} s of the resume "
        f"({len(second)} of {len(ranks)} did): the job may compute that long between them, or be stuck")
    step = max(stepped.values()) - resumed_at if per_step and len(stepped) == len(ranks) else None
    return AfterMove(measured=first is not None, why_not=why, ranks=len(ranks),
                     first_collectives_s=None if first is None else round(first, 4),
                     first_step_s=None if step is None else round(step, 4),
                     ops_per_step=max(per_step.values()) if per_step else None,
                     back_to_speed_s=None if back is None else round(back, 4),
                     collectives_per_s_before=None if rate_before is None else round(rate_before, 3),
                     collectives_per_s_after=None if after is None else round(after, 3),
                     step_time_ratio=round(rate_before / after, 3) if rate_before and after else None,
                     watched_s=round((history[-1].at if history else now()) - resumed_at, 3))


def steps_redone(nccl: bool, at: dict[str, int], per_step: dict[str, int], now: dict[str, list[dict[str, Any]]],
                 unread: str | None) -> dict[str, Any]:
    """The steps the job does again: for an NCCL job, the operations its surviving ranks issued
    since the snapshot (their shims' counters, read just before they are stopped) over the
    operations a step takes: the period of their trails at the snapshot (per_step_by_worker), or,
    for a snapshot taken before a rank had run three steps (its trail too short to show one), the
    period of the survivors' trails now (`now` read with its trail: the program's step is the same
    one).  A job without the shim's communicators shows no progress pitstop can count: `lost_s`
    only."""
    if not nccl or not at:
        return {"steps_redone": None, "steps_redone_why": "the job shows no progress pitstop can count "
                "without a change to it (no NCCL shim); lost_s says how long it ran since the snapshot"}
    if unread is not None:
        return {"steps_redone": None, "steps_redone_why": f"the surviving ranks' counters could not be read: "
                f"{unread}"}
    ops = {w: sum(block_ops(b) for b in bs) - at[w] for w, bs in now.items() if w in at and bs}
    if not ops:
        return {"steps_redone": None, "steps_redone_why": "no surviving rank's counters could be read: "
                "each had ended (or runs no NCCL communicator of the job)"}
    per_step = {**per_step_by_worker(now), **per_step}
    steps = {w: round(n / per_step[w], 1) for w, n in ops.items() if per_step.get(w)}
    if not steps:
        return {"ops_redone": max(ops.values()), "steps_redone": None,
                "steps_redone_why": "no step period showed in the ranks' trails, at the snapshot or now"}
    return {"ops_redone": max(ops.values()), "steps_redone": max(steps.values())}

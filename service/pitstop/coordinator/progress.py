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

A job without the shim's communicators (gloo) shows no progress the coordinator can see without
a change to it: `measured` is false, with why.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

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
            if rate_before and back is None and len(second) == len(ranks):
                past = [h for h in history if h.at <= t - RATE_WINDOW_S and h.at >= resumed_at]
                r = rate(past[-1], s) if past else None
                if r is not None and r >= BACK_TO_SPEED * rate_before:
                    back = t - resumed_at
        done_early = back is not None and len(second) == len(ranks) and t - resumed_at >= 3 * RATE_WINDOW_S
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
    return AfterMove(measured=first is not None, why_not=why, ranks=len(ranks),
                     first_collectives_s=None if first is None else round(first, 4),
                     back_to_speed_s=None if back is None else round(back, 4),
                     collectives_per_s_before=None if rate_before is None else round(rate_before, 3),
                     collectives_per_s_after=None if after is None else round(after, 3),
                     step_time_ratio=round(rate_before / after, 3) if rate_before and after else None,
                     watched_s=round((history[-1].at if history else now()) - resumed_at, 3))

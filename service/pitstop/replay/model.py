"""The price of a failure history, with pitstop and with checkpoint-restart: a model.

One job runs on `hosts` hosts of `gpus_per_host` GPUs; every event of the trace takes one of its
hosts away, and the job needs a replacement to go on at full size.  Replacements come from spares
held in each failure domain the trace names (`spares_per_domain`) or in a pool for any domain
(`pooled_spares`); a spare used is back (the repaired host) `repair_h` later.  With no spare free,
the job waits for the first one back.  Per event, in GPU-hours (hours x the job's GPUs, since
every GPU of a synchronous job waits), each method priced by its `Costs` (pricing.py says where
each figure comes from):

- planned (the host still runs): pitstop moves its ranks (`planned_s`, the move's pause);
  checkpoint-restart saves a checkpoint and restarts (`planned_s`, save and restart).
- unplanned (the host died): `detection_s` until the failure is acted on, `recover_s` until the
  job runs again (pitstop: the recovery from its last snapshot; checkpoint-restart: the restart),
  and the work since the last snapshot or checkpoint is redone (one every `every_h` from the
  trace's start).
- either: plus the wait for a spare.
- periodic: each of pitstop's snapshots costs the job `each_s`, every `every_h`: charged to
  pitstop.  The job's checkpoints (checkpoint-restart's `each_s` every `every_h`) are common to
  both (a pitstop job keeps them for what it cannot recover) and reported apart, as are the
  spares held idle.

The job's down spells are merged, not summed: hosts of one rack failing together cost one
restart and one loss of work, a failure during a restart only lengthens it, and a job that was
not running loses no work.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from pitstop.errors import InvalidRequest
from pitstop.replay.trace import Event

Method = Literal["pitstop", "checkpoint_restart"]


@dataclass(frozen=True)
class Costs:
    """One method's costs: per event (seconds of the whole job) and periodic."""
    planned_s: float    # a planned event's pause
    detection_s: float  # an unplanned event: until the failure is acted on
    recover_s: float    # ... then until the job runs again
    every_h: float      # snapshots (pitstop) or checkpoints (checkpoint-restart), every
    each_s: float       # the job's time each one costs

    def bad(self, name: str) -> list[str]:
        return [f"{name}.{k}={v}" for k, v in asdict(self).items()
                if not math.isfinite(v) or v < 0 or (k == "every_h" and v <= 0)]


@dataclass(frozen=True)
class Inputs:
    hosts: int
    pitstop: Costs
    restart: Costs
    gpus_per_host: int = 8
    spares_per_domain: int = 0
    pooled_spares: int = 1
    repair_h: float = 24.0
    duration_h: float | None = None  # default: the trace's last event

    def check(self) -> None:
        bad = [f"{k}={v}" for k, v in (("hosts", self.hosts), ("gpus_per_host", self.gpus_per_host),
                                       ("spares_per_domain", self.spares_per_domain),
                                       ("pooled_spares", self.pooled_spares), ("repair_h", self.repair_h),
                                       ("duration_h", self.duration_h))
               if v is not None and (v < 0 or (k in ("hosts", "gpus_per_host") and v <= 0))]
        bad += self.pitstop.bad("pitstop") + self.restart.bad("checkpoint_restart")
        if bad:
            raise InvalidRequest(f"replay inputs out of range: {', '.join(bad)}", code="bad_replay_input",
                                 action="hosts, GPUs per host and the intervals must be above 0; times and counts "
                                        "0 or more")

    @property
    def job_gpus(self) -> int:
        return self.hosts * self.gpus_per_host


@dataclass
class DomainCoverage:
    events: int = 0
    own_spare: int = 0     # served at once by a spare of the event's own domain
    pooled: int = 0        # served at once by a pooled spare
    waited: int = 0        # no spare free: the job waited for one
    wait_h: float = 0.0

    @property
    def covered_share(self) -> float:
        """The share of this domain's events its own spares covered."""
        return self.own_spare / self.events if self.events else 0.0


@dataclass
class Lost:
    """One method's GPU-hours lost over the history."""
    planned_gpu_h: float    # down for planned events
    unplanned_gpu_h: float  # down for unplanned events: detection and the pause
    work_gpu_h: float       # work redone since the last snapshot or checkpoint
    periodic_gpu_h: float   # pitstop: its snapshots; checkpoint-restart: none (its checkpoints are common)

    @property
    def total(self) -> float:
        return self.planned_gpu_h + self.unplanned_gpu_h + self.work_gpu_h + self.periodic_gpu_h


@dataclass
class Result:
    inputs: Inputs
    duration_h: float
    events: int
    planned: int
    unplanned: int
    failures: int                     # unplanned events at distinct times (a rack's hosts together: one)
    pitstop: Lost
    restart: Lost
    wait_gpu_h: float                 # what waiting for spares added to checkpoint-restart's down time
    checkpoints_gpu_h: float          # the job's own checkpoints, common to both
    spares_idle_gpu_h: float          # spares held, common to both
    coverage: dict[str, DomainCoverage] = field(default_factory=dict)

    @property
    def lost_pitstop_gpu_h(self) -> float:
        return self.pitstop.total

    @property
    def lost_restart_gpu_h(self) -> float:
        return self.restart.total

    @property
    def saved_gpu_h(self) -> float:
        return self.restart.total - self.pitstop.total

    def per_planned_gpu_h(self, method: Method) -> float | None:
        """GPU-hours per planned event."""
        lost = self.pitstop if method == "pitstop" else self.restart
        return lost.planned_gpu_h / self.planned if self.planned else None

    def per_failure_gpu_h(self, method: Method) -> float | None:
        """GPU-hours per failure (unplanned events at one time count once): down, work redone and,
        for pitstop, its snapshots' cost over the history."""
        lost = self.pitstop if method == "pitstop" else self.restart
        return (lost.unplanned_gpu_h + lost.work_gpu_h + lost.periodic_gpu_h) / self.failures if self.failures else None

    @property
    def break_even_move_pause_s(self) -> float | None:
        """The pause of one move at which pitstop saves nothing on a planned event (None: no
        planned event)."""
        return self.inputs.restart.planned_s if self.planned else None


class _Spares:
    """Spares by domain, and the pool; each one is free from a time on (a heap per place)."""

    def __init__(self, i: Inputs, domains: list[str]) -> None:
        self.repair_h = i.repair_h
        self.own = {d: [0.0] * i.spares_per_domain for d in domains}
        self.pool = [0.0] * i.pooled_spares

    def take(self, domain: str, t: float) -> tuple[str, float]:
        """Where the replacement came from (own, pooled, waited) and when it was free."""
        own, pool = self.own.get(domain, []), self.pool
        for place, heap in (("own", own), ("pooled", pool)):
            if heap and heap[0] <= t:
                heapq.heapreplace(heap, t + self.repair_h)
                return place, t
        candidates = [h for h in (own, pool) if h]
        if not candidates:
            return "none", float("inf")
        heap = min(candidates, key=lambda h: h[0])
        free = heap[0]
        heapq.heapreplace(heap, free + self.repair_h)
        return "waited", free


def _timeline(rows: list[tuple[float, str, float]], c: Costs, waits: bool = True) -> tuple[dict[str, float], float]:
    """Hours the job was down by the kind of event that took it down, and hours of work it
    lost, over the events (time, kind, wait for a spare) priced by `c`.  Down spells that overlap
    count once: a rack's hosts failing together cost one restart, a failure during a restart
    only lengthens it, and work is lost only by a job that was running."""
    down = {"planned": 0.0, "unplanned": 0.0}
    work = until = resumed = 0.0
    for t, kind, w in rows:
        cost_h = (c.planned_s if kind == "planned" else c.detection_s + c.recover_s) / 3600
        end = t + (w if waits else 0.0) + cost_h
        if t >= until:  # it was running
            if kind == "unplanned":
                work += min(t % c.every_h, t - resumed)
            down[kind] += end - t
            until = end
        elif end > until:
            down[kind] += end - until
            until = end
        resumed = until
    return down, work


def replay(events: list[Event], i: Inputs) -> Result:
    i.check()
    if not events:
        raise InvalidRequest("the trace has no events", code="bad_trace", action="give at least one event")
    duration = i.duration_h if i.duration_h is not None else max(e.time_h for e in events)
    domains = sorted({e.domain for e in events})
    spares = _Spares(i, domains)
    cov = {d: DomainCoverage() for d in domains}
    rows: list[tuple[float, str, float]] = []
    for e in sorted(events, key=lambda e: e.time_h):
        place, free = spares.take(e.domain, e.time_h)
        c = cov[e.domain]
        c.events += 1
        if place == "none":
            raise InvalidRequest(f"no spare at all for the event at {e.time_h} h on {e.host}: with no spare the "
                                 "job cannot go on at full size", code="bad_replay_input",
                                 action="hold at least one spare (--pooled-spares or --spares-per-domain)")
        w = free - e.time_h
        if place == "own":
            c.own_spare += 1
        elif place == "pooled":
            c.pooled += 1
        else:
            c.waited += 1
            c.wait_h += w
        rows.append((e.time_h, e.kind, w))
    gpus = i.job_gpus
    down_p, work_p = _timeline(rows, i.pitstop)
    down_r, work_r = _timeline(rows, i.restart)
    down_r0, _ = _timeline(rows, i.restart, waits=False)
    n_spares = i.spares_per_domain * len(domains) + i.pooled_spares
    planned = sum(1 for e in events if e.kind == "planned")
    return Result(inputs=i, duration_h=duration, events=len(events), planned=planned,
                  unplanned=len(events) - planned,
                  failures=len({e.time_h for e in events if e.kind == "unplanned"}),
                  pitstop=Lost(down_p["planned"] * gpus, down_p["unplanned"] * gpus, work_p * gpus,
                               duration / i.pitstop.every_h * i.pitstop.each_s / 3600 * gpus),
                  restart=Lost(down_r["planned"] * gpus, down_r["unplanned"] * gpus, work_r * gpus, 0.0),
                  wait_gpu_h=(sum(down_r.values()) - sum(down_r0.values())) * gpus,
                  checkpoints_gpu_h=duration / i.restart.every_h * i.restart.each_s / 3600 * gpus,
                  spares_idle_gpu_h=n_spares * i.gpus_per_host * duration, coverage=cov)


COST_FIELDS = ("planned_s", "detection_s", "recover_s", "every_h", "each_s")
SPARE_FIELDS = ("repair_h", "pooled_spares", "spares_per_domain")


def _with(i: Inputs, name: str, x: float) -> Inputs:
    side, _, f = name.partition(".")
    if side == "pitstop":
        return replace(i, pitstop=replace(i.pitstop, **{f: x}))
    if side == "checkpoint_restart":
        return replace(i, restart=replace(i.restart, **{f: x}))
    return replace(i, **{name: x})  # type: ignore[arg-type]  # a spare field: an int or a float


def _value(i: Inputs, name: str) -> float:
    side, _, f = name.partition(".")
    if side in ("pitstop", "checkpoint_restart"):
        return getattr(i.pitstop if side == "pitstop" else i.restart, f)
    return getattr(i, name)


def sensitivity(events: list[Event], i: Inputs) -> list[dict]:
    """How pitstop's saving moves when each input is halved and doubled (spare counts: one less
    and one more), the others held: which input the answer hangs on."""
    base = replay(events, i).saved_gpu_h
    names = [f"{s}.{f}" for s in ("pitstop", "checkpoint_restart") for f in COST_FIELDS
             if not (s == "checkpoint_restart" and f == "each_s")] + list(SPARE_FIELDS)
    out = []
    for name in names:
        v = _value(i, name)
        lows_highs = (max(0, v - 1), v + 1) if isinstance(v, int) else (v / 2, v * 2)
        row: dict = {"input": name, "value": v, "base_saved_gpu_h": base}
        for tag, x in zip(("low", "high"), lows_highs):
            row[f"{tag}_value"] = x
            try:
                row[f"{tag}_saved_gpu_h"] = replay(events, _with(i, name, x)).saved_gpu_h
            except InvalidRequest:  # e.g. no spare left at all
                row[f"{tag}_saved_gpu_h"] = None
        out.append(row)
    return sorted(out, key=lambda r: -max(abs((r.get("low_saved_gpu_h") or base) - base),
                                          abs((r.get("high_saved_gpu_h") or base) - base)))


def _gap(events: list[Event], i: Inputs) -> float:
    r = replay(events, i)
    return r.pitstop.total - r.restart.total


def break_even_interval(events: list[Event], i: Inputs, points: int = 160) -> dict[str, float | None]:
    """Over this history: the snapshot interval at which pitstop loses least, and the shortest
    and the longest at which it loses no more than checkpoint-restart (None: at none), from 5 s
    to a week, everything else held."""
    lo_h, hi_h = 5 / 3600, 168.0
    grid = [lo_h * (hi_h / lo_h) ** (k / (points - 1)) for k in range(points)]
    gaps = [_gap(events, replace(i, pitstop=replace(i.pitstop, every_h=h))) for h in grid]
    best = grid[min(range(points), key=lambda k: gaps[k])]
    wins = [k for k, g in enumerate(gaps) if g <= 0]
    if not wins:
        return {"best_h": best, "shortest_h": None, "longest_h": None}

    def edge(a: float, b: float) -> float:  # a loses, b wins
        for _ in range(40):
            m = math.sqrt(a * b)
            if _gap(events, replace(i, pitstop=replace(i.pitstop, every_h=m))) <= 0:
                b = m
            else:
                a = m
        return b
    first, last = wins[0], wins[-1]
    shortest = grid[first] if first == 0 else edge(grid[first - 1], grid[first])
    longest = grid[last] if last == points - 1 else edge(grid[last + 1], grid[last])
    return {"best_h": best, "shortest_h": shortest, "longest_h": longest}


def break_even(events: list[Event], make: Callable[[float], Inputs], lo: float = 1e-3,
               hi: float = 1e3) -> float | None:
    """The x in [lo, hi] at which pitstop loses as much as checkpoint-restart over this history,
    where make(x) prices pitstop better as x grows (a rate); None where it loses even at hi."""
    if _gap(events, make(hi)) > 0:
        return None
    if _gap(events, make(lo)) <= 0:
        return lo
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        if _gap(events, make(mid)) > 0:
            lo = mid
        else:
            hi = mid
    return hi


def median_move_pause_s(ops: list[dict]) -> float | None:
    """The median pause of succeeded evacuations (the coordinator's operations): measured moves."""
    pauses = [o["metadata"]["downtime_s"] for o in ops
              if o.get("metadata", {}).get("result") == "succeeded" and o["metadata"].get("downtime_s") is not None]
    return statistics.median(pauses) if pauses else None

"""The price of a failure history, with pitstop and with checkpoint-restart.

One job runs on `hosts` hosts of `gpus_per_host` GPUs; every event of the trace takes one of its
hosts away, and the job needs a replacement to go on at full size.  Replacements come from spares
held in each failure domain the trace names (`spares_per_domain`) or in a pool for any domain
(`pooled_spares`);
a spare used is back (the repaired host) `repair_h` later.  With no spare free, the job waits
for the first one back.  Per event, in GPU-hours (hours x the job's GPUs, since every GPU of a
synchronous job waits):

- checkpoint-restart, planned: save a checkpoint, then restart (`checkpoint_save_s + restart_s`);
  unplanned: the work since the last checkpoint is lost (checkpoints every
  `checkpoint_interval_h` from the trace's start), then restart.
- pitstop, planned: one host's move (`move_pause_s`).  Unplanned: as checkpoint-restart, since
  pitstop moves only hosts that still run (recovering from snapshots is not built yet); the
  report says how much of the difference that leaves on the table.
- either: plus the wait for a spare.

The job's down spells are merged, not summed: hosts of one rack failing together cost one
restart and one loss of work, a failure during a restart only lengthens it, and a job that was
not running loses no work.

Costs common to both are reported apart, not added to either: the job's checkpoints
(`checkpoint_save_s` every interval; pitstop's jobs keep checkpointing for what it cannot move)
and the spares held idle.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import asdict, dataclass, field, replace

from pitstop.errors import InvalidRequest
from pitstop.replay.trace import Event

# Defaults: bench/projection.py's estimates for one 8-GPU host of a 1,024-GPU job (2026-12-02,
# CUDA checkpoint rates assumed at PCIe Gen5): pitstop's pause 199 s; checkpoint-restart's save
# 10 s (10 GB per GPU at 1 TB/s aggregate) and relaunch, NCCL init and load 90 s.  Measured
# figures from a real fleet should replace them: `--moves-from` takes the median pause of the
# coordinator's succeeded evacuations.
DEFAULT_MOVE_PAUSE_S = 199.0
DEFAULT_RESTART_S = 90.0
DEFAULT_SAVE_S = 10.0


@dataclass(frozen=True)
class Inputs:
    hosts: int
    gpus_per_host: int = 8
    spares_per_domain: int = 0
    pooled_spares: int = 1
    repair_h: float = 24.0
    move_pause_s: float = DEFAULT_MOVE_PAUSE_S
    restart_s: float = DEFAULT_RESTART_S
    checkpoint_save_s: float = DEFAULT_SAVE_S
    checkpoint_interval_h: float = 1.0
    duration_h: float | None = None  # default: the trace's last event

    def check(self) -> None:
        bad = [f"{k}={v}" for k, v in asdict(self).items()
               if v is not None and (v < 0 or (k in ("hosts", "gpus_per_host", "checkpoint_interval_h") and v <= 0))]
        if bad:
            raise InvalidRequest(f"replay inputs out of range: {', '.join(bad)}", code="bad_replay_input",
                                 action="hosts, GPUs per host and the checkpoint interval must be above 0; "
                                        "times and counts 0 or more")

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
class Result:
    inputs: Inputs
    duration_h: float
    events: int
    planned: int
    unplanned: int
    lost_pitstop_gpu_h: float
    lost_restart_gpu_h: float
    wait_gpu_h: float                 # what waiting for spares added to checkpoint-restart's down time
    unplanned_lost_work_gpu_h: float  # work since the last checkpoint, lost (with checkpoint-restart)
    checkpoints_gpu_h: float          # the job's own checkpoints, common to both
    spares_idle_gpu_h: float          # spares held, common to both
    coverage: dict[str, DomainCoverage] = field(default_factory=dict)

    @property
    def saved_gpu_h(self) -> float:
        return self.lost_restart_gpu_h - self.lost_pitstop_gpu_h

    @property
    def break_even_move_pause_s(self) -> float | None:
        """The pause of one move at which pitstop saves nothing (None: no planned event)."""
        if not self.planned:
            return None
        i = self.inputs
        return i.checkpoint_save_s + i.restart_s


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


def _timeline(rows: list[tuple[float, str, float, float]], planned_h: float, restart_h: float,
              waits: bool = True) -> tuple[float, float]:
    """Hours the job was down, and hours of work it lost, over the events (time, kind, wait,
    hours since the last checkpoint).  Down spells that overlap count once: a rack's hosts
    failing together cost one restart, a failure during a restart only lengthens it, and work is
    lost only by a job that was running."""
    down = work = 0.0
    until = resumed = 0.0
    for t, kind, w, since in rows:
        end = t + (w if waits else 0.0) + (planned_h if kind == "planned" else restart_h)
        if t >= until:  # it was running
            if kind == "unplanned":
                work += min(since, t - resumed)
            down += end - t
            until = end
        elif end > until:
            down += end - until
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
    rows: list[tuple[float, str, float, float]] = []
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
        rows.append((e.time_h, e.kind, w, e.time_h % i.checkpoint_interval_h if e.kind == "unplanned" else 0.0))
    gpus = i.job_gpus
    restart_h = i.restart_s / 3600
    down_r, work_r = _timeline(rows, (i.checkpoint_save_s + i.restart_s) / 3600, restart_h)
    down_p, work_p = _timeline(rows, i.move_pause_s / 3600, restart_h)
    down_r0, _ = _timeline(rows, (i.checkpoint_save_s + i.restart_s) / 3600, restart_h, waits=False)
    n_spares = i.spares_per_domain * len(domains) + i.pooled_spares
    planned = sum(1 for e in events if e.kind == "planned")
    return Result(inputs=i, duration_h=duration, events=len(events), planned=planned,
                  unplanned=len(events) - planned, lost_pitstop_gpu_h=(down_p + work_p) * gpus,
                  lost_restart_gpu_h=(down_r + work_r) * gpus, wait_gpu_h=(down_r - down_r0) * gpus,
                  unplanned_lost_work_gpu_h=work_r * gpus,
                  checkpoints_gpu_h=duration / i.checkpoint_interval_h * i.checkpoint_save_s / 3600 * gpus,
                  spares_idle_gpu_h=n_spares * i.gpus_per_host * duration, coverage=cov)


SENSITIVE = ("move_pause_s", "restart_s", "checkpoint_save_s", "checkpoint_interval_h", "repair_h",
             "pooled_spares", "spares_per_domain")


def sensitivity(events: list[Event], i: Inputs) -> list[dict]:
    """How pitstop's saving moves when each input is halved and doubled (spare counts: one less
    and one more), the others held: which input the answer hangs on."""
    base = replay(events, i).saved_gpu_h
    out = []
    for name in SENSITIVE:
        v = getattr(i, name)
        lows_highs = (max(0, v - 1), v + 1) if isinstance(v, int) else (v / 2, v * 2)
        row: dict = {"input": name, "value": v, "base_saved_gpu_h": base}
        for tag, x in zip(("low", "high"), lows_highs):
            try:
                row[f"{tag}_value"] = x
                row[f"{tag}_saved_gpu_h"] = replay(events, replace(i, **{name: x})).saved_gpu_h
            except InvalidRequest:  # e.g. no spare left at all
                row[f"{tag}_saved_gpu_h"] = None
        out.append(row)
    return sorted(out, key=lambda r: -max(abs((r.get("low_saved_gpu_h") or base) - base),
                                          abs((r.get("high_saved_gpu_h") or base) - base)))


def median_move_pause_s(ops: list[dict]) -> float | None:
    """The median pause of succeeded evacuations (the coordinator's operations): measured moves."""
    pauses = [o["metadata"]["downtime_s"] for o in ops
              if o.get("metadata", {}).get("result") == "succeeded" and o["metadata"].get("downtime_s") is not None]
    return statistics.median(pauses) if pauses else None

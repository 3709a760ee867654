"""One failure history priced on each stack: the replay itself, per-event costs in GPU-hours,
the break-even snapshot interval and CUDA checkpoint rate, the sensitivity, and where pitstop
loses.  What `pitstop replay` prints (report.py renders it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pitstop.errors import InvalidRequest
from pitstop.replay import pricing
from pitstop.replay.model import Inputs, Result, break_even, break_even_interval, replay, sensitivity
from pitstop.replay.trace import Event

MODEL = ("a projection, not a measurement: a model priced with measured (CPU VM, lent H200 VM), cited and "
         "assumed inputs, each marked")


@dataclass(frozen=True)
class Job:
    hosts: int
    gpus_per_host: int = 8
    spares_per_domain: int = 0
    pooled_spares: int = 1
    repair_h: float = 24.0
    duration_h: float | None = None
    ranks: pricing.Ranks = "gpu"
    rewire_on_path: bool = True
    snapshot_every_h: float | None = None   # default: the best at this history's failure rate
    overrides: dict[str, float] = field(default_factory=dict)  # pricing inputs given
    pitstop_given: dict[str, float] = field(default_factory=dict)  # Costs fields given (all stacks)
    restart_given: dict[str, float] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return self.hosts * self.gpus_per_host


def mtbf_of(events: list[Event], duration_h: float) -> float:
    """Hours between failures of the job in this history (unplanned events at one time count once)."""
    n = len({e.time_h for e in events if e.kind == "unplanned"})
    return duration_h / n if n else float("inf")


def _inputs(job: Job, stack: pricing.Stack, v: dict[str, float], every_h: float | None, mtbf: float) -> Inputs:
    p = pricing.price(job.gpus, stack, v, job.ranks, job.rewire_on_path, every_h,
                      mtbf if mtbf != float("inf") else 1e9)
    restart = replace(p.restart, **job.restart_given)
    restart = replace(restart, planned_s=restart.each_s + restart.recover_s)  # a planned event: save, then restart
    return Inputs(hosts=job.hosts, gpus_per_host=job.gpus_per_host, spares_per_domain=job.spares_per_domain,
                  pooled_spares=job.pooled_spares, repair_h=job.repair_h, duration_h=job.duration_h,
                  pitstop=replace(p.pitstop, **job.pitstop_given), restart=restart)


def _per_event(r: Result, gpus: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, f in (("planned", r.per_planned_gpu_h), ("failure", r.per_failure_gpu_h)):
        gh = {"pitstop": f("pitstop"), "checkpoint_restart": f("checkpoint_restart")}
        out[kind] = {"gpu_h": gh, "s": {k: None if x is None else x * 3600 / gpus for k, x in gh.items()}}
    return out


def _losses(r: Result) -> list[str]:
    said = []
    for kind in ("planned", "failure"):
        p = (r.per_planned_gpu_h if kind == "planned" else r.per_failure_gpu_h)("pitstop")
        c = (r.per_planned_gpu_h if kind == "planned" else r.per_failure_gpu_h)("checkpoint_restart")
        if p is not None and c is not None and p > c:
            said.append(f"{'a planned event' if kind == 'planned' else 'a failure'}: {p:,.1f} GPU-hours against "
                        f"checkpoint-restart's {c:,.1f}")
    if r.saved_gpu_h < 0:
        said.append(f"the whole history: {-r.saved_gpu_h:,.0f} GPU-hours more than checkpoint-restart")
    return said


def one_stack(events: list[Event], job: Job, stack: pricing.Stack, minutes: tuple[int, ...] = (10, 30, 60),
              sens: bool = True) -> dict[str, Any]:
    v = pricing.values(**job.overrides)
    mtbf = mtbf_of(events, job.duration_h if job.duration_h is not None else max(e.time_h for e in events))
    i = _inputs(job, stack, v, job.snapshot_every_h, mtbf)
    r = replay(events, i)
    priced = pricing.price(job.gpus, stack, v, job.ranks, job.rewire_on_path, i.pitstop.every_h)

    def at_rate(every_h: float):  # noqa: ANN202 - a pricing of pitstop with the CUDA rates scaled by k
        def make(k: float) -> Inputs:
            return _inputs(job, stack, pricing.scaled(v, k), every_h, mtbf)
        return make

    rates: dict[str, dict[str, float] | None] = {}
    if job.ranks == "gpu":
        for m in minutes:
            k = break_even(events, at_rate(m / 60))
            rates[f"{m}_min"] = None if k is None else {
                "snapshot_gbps": k * pricing.snapshot_gbps(job.gpus, stack, v),
                "cuda_checkpoint_gbps_out": k * v["cuda_checkpoint_gbps"]}
    return {
        "costs": {"pitstop": asdict(i.pitstop), "checkpoint_restart": asdict(i.restart)},
        "terms": priced.terms,
        "lost_gpu_h": {"pitstop": {**asdict(r.pitstop), "total": r.pitstop.total},
                       "checkpoint_restart": {**asdict(r.restart), "total": r.restart.total}},
        "saved_gpu_h": r.saved_gpu_h,
        "saved_share": r.saved_gpu_h / r.restart.total if r.restart.total else None,
        "per_event": _per_event(r, job.gpus),
        "wait_for_spare_gpu_h": r.wait_gpu_h,
        "common": {"checkpoints_gpu_h": r.checkpoints_gpu_h, "spares_idle_gpu_h": r.spares_idle_gpu_h},
        "break_even": {"move_pause_s": r.break_even_move_pause_s,
                       "snapshot_interval": break_even_interval(events, i),
                       "device_rates_at_snapshot_every": rates,
                       "measured": {"snapshot_gbps": pricing.snapshot_gbps(job.gpus, stack, v),
                                    "cuda_checkpoint_gbps_out": v["cuda_checkpoint_gbps"]}},
        "where_pitstop_loses": _losses(r),
        "sensitivity": sensitivity(events, i) if sens else [],
        "_result": r,
    }


def study(events: list[Event], job: Job, stacks: tuple[pricing.Stack, ...] = pricing.STACKS,
          minutes: tuple[int, ...] = (10, 30, 60)) -> dict[str, Any]:
    """Every stack's pricing of the history, both methods' ranges over the stacks, and every
    input with its kind and source."""
    if not events:
        raise InvalidRequest("the trace has no events", code="bad_trace", action="give at least one event")
    runs = {s: one_stack(events, job, s, minutes) for s in stacks}
    r0: Result = next(iter(runs.values()))["_result"]
    given = {**{f"pitstop.{k}": x for k, x in job.pitstop_given.items()},
             **{f"checkpoint_restart.{k}": x for k, x in job.restart_given.items()}}

    def span(f: Any) -> list[float | None]:
        xs = [f(x) for x in runs.values()]
        xs = [x for x in xs if x is not None]
        return [min(xs), max(xs)] if xs else [None, None]
    ranges = {f"{m}_{what}": span(lambda x, m=m, what=what: (
        x["lost_gpu_h"][m]["total"] if what == "lost_gpu_h" else x["per_event"][what]["gpu_h"][m]))
        for m in ("pitstop", "checkpoint_restart") for what in ("lost_gpu_h", "planned", "failure")}
    return {
        "model": MODEL,
        "duration_h": r0.duration_h, "events": r0.events, "planned": r0.planned, "unplanned": r0.unplanned,
        "failures": r0.failures,
        "mtbf_h": r0.duration_h / r0.failures if r0.failures else None,  # none: no failure (JSON has no infinity)
        "job": {"hosts": job.hosts, "gpus": job.gpus, "ranks": job.ranks, "rewire_on_path": job.rewire_on_path,
                "spares_per_domain": job.spares_per_domain, "pooled_spares": job.pooled_spares,
                "repair_h": job.repair_h},
        "inputs": pricing.described(job.overrides),
        "given": {k: {"value": x, "kind": "given", "source": "given on the command line"} for k, x in given.items()},
        "published": pricing.PUBLISHED,
        "stacks": runs,
        "ranges": ranges,
        "coverage": {d: asdict(c) | {"covered_share": c.covered_share} for d, c in r0.coverage.items()},
    }


def public(d: dict[str, Any]) -> dict[str, Any]:
    """The study without its Result objects (what --json prints)."""
    return {**d, "stacks": {s: {k: x for k, x in run.items() if k != "_result"} for s, run in d["stacks"].items()}}

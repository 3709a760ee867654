"""Commands about the fleet as a whole: `pitstop slurm-watch` (Slurm drains become moves) and
`pitstop replay` (a failure history priced)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from pitstop.cli.common import (
    app,
    client,
    coordinator_option,
    err,
    fail,
    setup_logs,
)
from pitstop.errors import FailedPrecondition, InvalidRequest, PitstopError

if TYPE_CHECKING:
    from pitstop.replay.pricing import Stack


@app.command("slurm-watch")
def slurm_watch(
    coordinator: Optional[str] = coordinator_option(),
    reason_prefix: str = typer.Option("", "--reason-prefix", envvar="PITSTOP_SLURM_REASON_PREFIX",
                                      help="act only on drains whose reason starts with this (default: every drain)"),
    reservation: str = typer.Option("pitstop_spares", "--reservation", envvar="PITSTOP_SLURM_RESERVATION",
                                    help="the Slurm reservation that keeps ordinary jobs off the spares "
                                         "('' to manage none)"),
    interval: float = typer.Option(1.0, "--interval", min=0.1, max=60.0, help="seconds between looks"),
    release_nodes: bool = typer.Option(False, "--release-nodes", envvar="PITSTOP_SLURM_RELEASE_NODES",
                                       help="once a node's ranks moved, take it out of their Slurm jobs' allocations "
                                            "so that it drains fully (their srun then reports those tasks killed)"),
    join_spares: bool = typer.Option(True, "--join-spares/--no-join-spares", envvar="PITSTOP_SLURM_JOIN_SPARES",
                                     help="add a spare that took a job's ranks to the Slurm job, with a step per "
                                          "moved rank (`pitstop hold`) that scancel ends"),
    log_json: bool = typer.Option(False, "--log-json"),
) -> None:
    """Move the ranks off Slurm nodes as they are drained, hold the spares back from Slurm's
    other jobs, and drain in Slurm the hosts pitstop finds degraded.  One per cluster; reads Slurm
    through its usual client configuration (SLURM_CONF), the coordinator with PITSTOP_TOKEN."""
    import signal as signals

    from pitstop.slurm.watch import SlurmCommands, Watcher

    setup_logs(log_json)
    c = client(coordinator)
    stop: list[int] = []
    for sig in (signals.SIGTERM, signals.SIGINT):
        signals.signal(sig, lambda n, _f: stop.append(n))
    Watcher(SlurmCommands(), c, reason_prefix=reason_prefix, reservation=reservation or None,
            release_nodes=release_nodes, join_spares=join_spares).run(
        interval, until=lambda: bool(stop))


def _same_coordinator(url: str) -> None:
    """--moves-from is read with the operator's token: only from the coordinator the operator is
    configured for (PITSTOP_COORDINATOR), never sent to whatever URL a command line names."""
    import httpx

    configured = os.environ.get("PITSTOP_COORDINATOR")

    def origin(u: str) -> tuple[str, str, int | None]:
        p = httpx.URL(u)
        return p.scheme, p.host, p.port
    try:
        same = configured is not None and origin(url) == origin(configured)
    except (httpx.InvalidURL, ValueError):
        same = False
    if not same:
        raise FailedPrecondition(f"--moves-from {url} is not the coordinator this shell is configured for "
                                 f"(PITSTOP_COORDINATOR={configured or 'unset'}): pitstop sends the operator's token "
                                 "to that coordinator only", code="not_the_coordinator",
                                 action="set PITSTOP_COORDINATOR to that coordinator's URL (and PITSTOP_TOKEN to its "
                                        "token), or give --move-pause-s")


def _checked(given: dict[str, float | None], ranks: str, stack: str) -> tuple[Stack, ...]:
    """The replay's figures finite, its rank kind and its stacks known; the stacks to price."""
    from pitstop.replay.pricing import STACKS

    bad = [f"--{n.replace('_', '-')} {v}" for n, v in given.items() if v is not None and not math.isfinite(v)]
    if bad:
        raise InvalidRequest(f"not a finite number: {', '.join(bad)}", code="bad_input",
                             action="give each figure as a finite number")
    if ranks not in ("gpu", "cpu"):
        raise InvalidRequest(f"--ranks {ranks}: neither gpu nor cpu", code="bad_input", action="give gpu or cpu")
    stacks: tuple[Stack, ...] | None = {"both": STACKS, "optimised": ("optimised",),
                                         "default": ("default",)}.get(stack)
    if stacks is None:
        raise InvalidRequest(f"--stack {stack}: not optimised, default or both", code="bad_input",
                             action="give optimised, default or both")
    return stacks


def _median_move_pause(moves_from: str) -> float:
    """The median pause of the succeeded evacuations the coordinator at `moves_from` keeps."""
    from pitstop.replay.model import median_move_pause_s
    from pitstop.wire.coordinator_client import CoordinatorClient

    _same_coordinator(moves_from)
    with CoordinatorClient(moves_from) as c:
        pause = median_move_pause_s(c.ops(done=True, limit=1000))
    if pause is None:
        raise PitstopError(f"the coordinator at {moves_from} has no succeeded evacuation to measure",
                           code="no_moves", action="give --move-pause-s")
    return pause


@app.command()
def replay(
    trace_file: Path = typer.Argument(..., help="the failure and maintenance history: CSV or JSON with "
                                      "time_h, host, kind (planned|unplanned), domain"),
    hosts: int = typer.Option(..., min=1, help="hosts the job runs on"),
    gpus_per_host: int = typer.Option(8, min=1),
    spares_per_domain: int = typer.Option(0, min=0, help="spares held in each failure domain"),
    pooled_spares: int = typer.Option(1, min=0, help="spares held for any domain"),
    repair_h: float = typer.Option(24.0, min=0, help="hours until a used spare is back (the host repaired)"),
    duration_h: Optional[float] = typer.Option(None, min=0, help="the trace's span (default: its last event)"),
    ranks: str = typer.Option("gpu", help="gpu: ranks with device memory and NCCL; cpu: the measured CPU ranks"),
    stack: str = typer.Option("both", help="checkpoint-restart's stack, and the NCCL pitstop rewires with: "
                              "optimised, default or both"),
    snapshot_every_min: Optional[float] = typer.Option(None, min=5 / 60, help="pitstop's snapshot interval "
                                                       "(default: the least costly at the trace's failure rate)"),
    rewire_off_path: bool = typer.Option(False, "--rewire-off-path", help="what-if: pitstop's NCCL rewire taken "
                                         "off the pause's critical path (not built)"),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="NAME=VALUE: a pricing input "
                                             "(pitstop/replay/pricing.py INPUTS), e.g. cuda_checkpoint_gbps=2"),
    move_pause_s: Optional[float] = typer.Option(None, min=0, help="pitstop's pause for one host's move "
                                                 "(default: priced; or --moves-from's median)"),
    moves_from: Optional[str] = typer.Option(None, help="a coordinator URL: the median pause of its succeeded "
                                             "evacuations is the move pause (PITSTOP_TOKEN)"),
    snapshot_pause_s: Optional[float] = typer.Option(None, min=0, help="the job's time one snapshot costs"),
    recovery_pause_s: Optional[float] = typer.Option(None, min=0, help="pitstop's recovery pause, stop to resume"),
    detection_s: Optional[float] = typer.Option(None, min=0, help="pitstop's time to declare a host failed"),
    restart_s: Optional[float] = typer.Option(None, min=0, help="checkpoint-restart: requeue, start, NCCL, load"),
    checkpoint_save_s: Optional[float] = typer.Option(None, min=0, help="the job's pause for one checkpoint"),
    checkpoint_interval_h: Optional[float] = typer.Option(None, min=0.001, help="hours between checkpoints"),
    as_json: bool = typer.Option(False, "--json"),
    chart: Optional[Path] = typer.Option(None, help="also write an SVG chart here"),
) -> None:
    """Price a failure history, a model: GPU-hours lost with pitstop (moves for planned events,
    recovery from in-memory snapshots for the others, the snapshots' own cost) and with
    checkpoint-restart, on an optimised and a default stack; per event and per failure; the
    break-even snapshot interval and CUDA checkpoint rate; where pitstop loses; every input with
    its kind and source."""
    from pitstop.replay import report, study, trace

    try:
        given = {"move_pause_s": move_pause_s, "snapshot_pause_s": snapshot_pause_s,
                 "recovery_pause_s": recovery_pause_s, "detection_s": detection_s, "restart_s": restart_s,
                 "checkpoint_save_s": checkpoint_save_s, "checkpoint_interval_h": checkpoint_interval_h,
                 "repair_h": repair_h, "duration_h": duration_h, "snapshot_every_min": snapshot_every_min}
        stacks = _checked(given, ranks, stack)
        overrides = _settings(set_ or [])
        events = trace.read(trace_file)
        source = str(trace_file)
        pause = move_pause_s
        if pause is None and moves_from:
            pause = _median_move_pause(moves_from)
            source += f"; move pause: the median of {moves_from}'s succeeded evacuations ({pause:.2f} s)"
        pit = {k: x for k, x in (("planned_s", pause), ("each_s", snapshot_pause_s),
                                 ("recover_s", recovery_pause_s), ("detection_s", detection_s)) if x is not None}
        res = {k: x for k, x in (("recover_s", restart_s), ("each_s", checkpoint_save_s),
                                 ("every_h", checkpoint_interval_h)) if x is not None}
        job = study.Job(hosts=hosts, gpus_per_host=gpus_per_host, spares_per_domain=spares_per_domain,
                        pooled_spares=pooled_spares, repair_h=repair_h, duration_h=duration_h,
                        ranks="gpu" if ranks == "gpu" else "cpu",
                        rewire_on_path=not rewire_off_path,
                        snapshot_every_h=None if snapshot_every_min is None else snapshot_every_min / 60,
                        overrides=overrides, pitstop_given=pit, restart_given=res)
        d = study.study(events, job, stacks)
    except PitstopError as e:
        fail(e, as_json)
    if chart:
        chart.write_text(report.svg(d))
    if as_json:
        print(json.dumps(study.public(d), indent=1))
    else:
        print(report.markdown(d, source), end="")


def _settings(pairs: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in pairs:
        name, eq, value = p.partition("=")
        try:
            x = float(value) if eq else float("nan")
        except ValueError:
            x = float("nan")
        if not math.isfinite(x) or x <= 0:
            raise InvalidRequest(f"--set {p}: give NAME=VALUE with a number above 0", code="bad_input",
                                 action="e.g. --set cuda_checkpoint_gbps=2 (names: pitstop/replay/pricing.py)")
        out[name.strip()] = x
    return out


@app.command("replay-synth")
def replay_synth(
    out_file: Path = typer.Argument(..., help="where the trace goes (.csv or .json)"),
    hosts: int = typer.Option(..., min=1),
    days: float = typer.Option(..., min=0.01),
    seed: int = typer.Option(0),
    hosts_per_rack: int = typer.Option(16, min=1, help="a host's failure domain is its rack"),
) -> None:
    """Write a synthetic trace at the failure rates of a public report (Meta's Llama 3 paper:
    419 unexpected and 47 planned interruptions in 54 days on 2,048 hosts); pitstop/replay/trace.py
    documents every rate and what is assumed."""
    from pitstop.replay import trace

    try:
        events = trace.synthesize(hosts, days, seed=seed, hosts_per_rack=hosts_per_rack)
    except PitstopError as e:
        fail(e)
    trace.write(events, out_file)
    planned = sum(1 for e in events if e.kind == "planned")
    err.print(f"{len(events)} events ({planned} planned, {len(events) - planned} unplanned) over {days:g} days "
              f"on {hosts} hosts written to {out_file}")

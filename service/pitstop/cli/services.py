"""The services' commands: `pitstop agent`, `pitstop coordinator`, `pitstop run` (the launcher)
and `pitstop doctor`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from pitstop.cli.common import (
    agent_option,
    app,
    fail,
    given,
    out,
    settings_of,
    setup_logs,
)
from pitstop.errors import PitstopError


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="print the checks as JSON")) -> None:
    """Check whether this host can capture and restore workers."""
    from pitstop.doctor import ready, run_checks

    checks = run_checks()
    ok, reasons = ready(checks)
    if as_json:
        print(json.dumps({"ready": ok, "reasons": reasons,
                          "checks": [c.__dict__ for c in checks]}, indent=1))
    else:
        t = Table(title="pitstop doctor")
        t.add_column("check")
        t.add_column("")
        t.add_column("detail")
        for c in checks:
            mark = {True: "[green]ok[/]", False: "[red]FAIL[/]" if c.required else "[yellow]warn[/]",
                    None: "[dim]-[/]"}[c.ok]
            t.add_row(c.name, mark, c.detail)
        out.print(t)
        out.print("[green]this host can migrate workers[/]" if ok else
                  "[red]this host cannot migrate workers:[/] " + "; ".join(reasons))
    raise typer.Exit(0 if ok else 1)



@app.command("provision-criu")
def provision_criu(
    carried: bool = typer.Option(True, "--carried/--stock-only", help="also build the CRIU pitstop carries "
                                 "(4.2.1 with pitstop's patches; needs gcc and make)"),
) -> None:
    """Give this host the CRIU pitstop runs: CRIU >= 4.2 (the host's if it passes `criu check`, else
    Debian's, unpacked into ~/.cache/pitstop/criu-4.2 without touching the host's packages), then the
    CRIU pitstop carries, built into ~/.cache/pitstop/criu-carried. Needs root and Debian's package
    archive; what `pitstop doctor` advises where CRIU is missing or stock."""
    from pitstop.criu import provision, runtime

    try:
        steps = provision.provision(carried)
    except PitstopError as e:
        fail(e)
    for s in steps:
        if s.ok:
            out.print(f"[green]ok[/]   {s.script}: {s.path}", soft_wrap=True)
        else:
            out.print(f"[red]failed[/] {s.script}:", soft_wrap=True)
            print("\n".join(s.log.strip().splitlines()[-15:]))
    runtime.locate.cache_clear()
    try:
        rt = runtime.locate()
    except PitstopError as e:
        fail(e)
    out.print(f"CRIU {rt.version_str} runs now ({rt.source}: {rt.binary})" + (
        "" if rt.carried or not carried else "; the carried CRIU did not build (see above): the stock one runs, "
        "and `pitstop doctor` says what that costs"), soft_wrap=True)
    raise typer.Exit(0 if steps[0].ok else 1)


@app.command()
def agent(
    name: Optional[str] = typer.Option(None, help="this host's name in the cluster (PITSTOP_AGENT_NAME; "
                                       "default: the host name)"),
    listen: Optional[str] = typer.Option(None, help="HOST:PORT for peers and the coordinator "
                                         "(PITSTOP_AGENT_LISTEN; default 127.0.0.1:7070)"),
    # No envvar= here: the flag taken from PITSTOP_COORDINATOR would beat PITSTOP_AGENT_COORDINATOR;
    # the settings read both, the agent's own first (agent/settings.py).
    coordinator: Optional[str] = typer.Option(None, help="the coordinator's URL (PITSTOP_AGENT_COORDINATOR, "
                                              "else PITSTOP_COORDINATOR)"),
    state_dir: Optional[Path] = typer.Option(None, help="where the agent keeps its state "
                                             "(PITSTOP_AGENT_STATE_DIR; default /var/lib/pitstop/agent)"),
    image_dir: Optional[Path] = typer.Option(None, help="where images go (PITSTOP_AGENT_IMAGE_DIR; default "
                                             "/run/pitstop/images/NAME; only root may change it or any directory above it)"),
    advertise_url: Optional[str] = typer.Option(None, help="URL peers and the coordinator use to reach this agent "
                                                "(PITSTOP_AGENT_ADVERTISE_URL; needed when --listen is a wildcard)"),
    spare: Optional[bool] = typer.Option(None, "--spare/--active", help="offer this host as a migration target "
                                         "(PITSTOP_AGENT_SPARE)", show_default=False),
    insecure: Optional[bool] = typer.Option(None, "--insecure", help="allow running without PITSTOP_CLUSTER_TOKEN "
                                            "(PITSTOP_AGENT_INSECURE)", show_default=False),
    worker_link: Optional[str] = typer.Option(None, help="uplink for workers' own addresses "
                                              "(`pitstop run --address`); default: the default route's link"),
    slurm_node: Optional[str] = typer.Option(None, help="the Slurm node this host is, for `pitstop slurm-watch` "
                                             "(PITSTOP_AGENT_SLURM_NODE; default: the short host name)"),
    failure_domain: Optional[str] = typer.Option(None, help="what this host fails together with (a rack, a power "
                                                 "feed): snapshot replicas of its ranks are kept outside it "
                                                 "(PITSTOP_AGENT_FAILURE_DOMAIN)"),
    log_json: bool = typer.Option(False, "--log-json"),
) -> None:
    """Run the host agent."""
    from pitstop.agent.server import serve
    from pitstop.agent.settings import AgentSettings

    setup_logs(log_json)
    kw = given(name=name, listen=listen, coordinator=coordinator, state_dir=state_dir, image_dir=image_dir,
                advertise_url=advertise_url, spare=spare, insecure=insecure, worker_link=worker_link,
                slurm_node=slurm_node, failure_domain=failure_domain)
    try:
        serve(settings_of(AgentSettings, **kw))
    except PitstopError as e:
        fail(e)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    job: str = typer.Option(..., help="job id shared by all ranks of the job"),
    agent_url: str = agent_option(),
    rank: Optional[int] = typer.Option(None, help="rank of this process tree (default: $RANK, else $GROUP_RANK, "
                                      "else $SLURM_PROCID under srun, else 0)"),
    host_nccl: bool = typer.Option(False, "--host-nccl", help="use pitstop's host NCCL (TCP, CPU) as libnccl.so.2"),
    no_shim: bool = typer.Option(False, "--no-shim", help="do not preload the NCCL shim"),
    address: Optional[str] = typer.Option(None, help="give the worker its own address A.B.C.D/P on the host's "
                                          "uplink subnet: its TCP connections then survive a move to any host "
                                          "on that segment"),
    snapshot_every: Optional[float] = typer.Option(
        None, "--snapshot-every", metavar="SECONDS",
        help="take an in-memory snapshot of the whole job this often, so that it recovers by itself from "
             "the sudden loss of a host (the smallest value any rank gives wins; a job whose ranks talk over "
             "TCP, as gloo's do, needs --address)"),
) -> None:
    """Run COMMAND so that pitstop can move it: pitstop run --job J --agent URL -- COMMAND [ARGS...]"""
    from pitstop.launcher.run import run as run_cmd

    args = list(ctx.args)
    if args and args[0] == "--":
        args = args[1:]
    raise typer.Exit(run_cmd(args, job=job, agent_url=agent_url, rank=rank, shim=not no_shim,
                             host_nccl=host_nccl, address=address, snapshot_every_s=snapshot_every))


@app.command()
def hold(
    worker: str = typer.Argument(..., help="the worker, JOB.RANK, that runs on this host now"),
    agent_url: str = agent_option(),
    no_output: bool = typer.Option(False, "--no-output", help="do not show the worker's output (its agent keeps it "
                                   "for `pitstop attach`)"),
) -> None:
    """Take up a moved worker's handle on the host it runs on now: this process then ends the worker
    when it ends, passes it the signals it gets, shows its output and exits with its status, as its
    launcher did where it ran before.  `pitstop slurm-watch` runs it as a step of the rank's Slurm job."""
    from pitstop.launcher.run import hold as hold_worker

    raise typer.Exit(hold_worker(worker, agent_url=agent_url, echo=not no_output))


@app.command()
def coordinator(
    listen: Optional[str] = typer.Option(None, help="HOST:PORT for operators and agents "
                                         "(PITSTOP_COORDINATOR_LISTEN; default 127.0.0.1:7000)"),
    db: Optional[str] = typer.Option(None, help="a SQLite file, or a postgresql://USER@HOST/DB URL that two or more "
                                     "coordinators share, one leading (PITSTOP_COORDINATOR_DB; default "
                                     "/var/lib/pitstop/coordinator.db)"),
    advertise_url: Optional[str] = typer.Option(None, "--advertise-url", help="how agents, operators and the "
                                                "other coordinators reach this one (PITSTOP_COORDINATOR_ADVERTISE_URL;"
                                                " default http(s)://LISTEN)"),
    insecure: Optional[bool] = typer.Option(None, "--insecure", help="allow running without tokens "
                                            "(PITSTOP_COORDINATOR_INSECURE)", show_default=False),
    log_json: bool = typer.Option(False, "--log-json"),
) -> None:
    """Run the coordinator (operator REST API, migration driver).  Two or more on one PostgreSQL
    database: one leads, the others stand by and take over within seconds of its loss."""
    from pitstop.coordinator.server import serve
    from pitstop.coordinator.settings import CoordinatorSettings

    setup_logs(log_json)
    try:
        serve(settings_of(CoordinatorSettings, **given(listen=listen, db=db, advertise_url=advertise_url,
                                                       insecure=insecure)))
    except PitstopError as e:
        fail(e)

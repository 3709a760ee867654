"""The `pitstop` command: a thin layer over the library (as runc is over libcontainer)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from pitstop import logs
from pitstop.errors import InvalidRequest, PitstopError

EXIT_FAILED, EXIT_USAGE, EXIT_STILL_RUNNING = 1, 2, 3
app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="pitstop: move training workers between hosts without stopping the job.\n\n"
                       "Exit status: 0 done; 1 failed or refused (the error says why and what to do); "
                       "2 a usage error (a flag or argument); 3 still running when --wait's --timeout ended "
                       "(the operation goes on: follow it with `pitstop ops ID`).")


def _version(value: bool) -> None:
    if value:
        from pitstop import __version__

        print(f"pitstop {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print pitstop's version and exit")) -> None:
    """pitstop: move training workers between hosts without stopping the job."""
err = Console(stderr=True)
out = Console()


def _fail(e: PitstopError, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps({"error": e.to_dict()}))
    else:
        # Not wrapped by rich: paths and ids in a message must survive copying and grep
        err.print(f"[bold red]error:[/] {e.message}", soft_wrap=True)
        if e.action:
            err.print(f"[bold]what to do:[/] {e.action}", soft_wrap=True)
    raise typer.Exit(1)


def _settings(cls, **kw):  # noqa: ANN001, ANN202 - a pydantic-settings class
    """Build settings; a bad value is an operator's error, said plainly, not a traceback."""
    from pydantic import ValidationError

    try:
        return cls(**kw)
    except ValidationError as e:
        prefix = cls.model_config.get("env_prefix", "")
        bad = "; ".join(f"{prefix}{'_'.join(map(str, x['loc'])).upper()}={x.get('input')!r}: {x['msg']}"
                        for x in e.errors())
        _fail(InvalidRequest(f"bad setting: {bad}",
                             action="fix the flag or the variable (environment, /etc/pitstop/*.env) and start again"))


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


def _logs(as_json: bool) -> None:
    """A service's logging (PITSTOP_LOG_LEVEL sets the level); a bad level is said, not raised."""
    try:
        logs.setup(json=as_json)
    except PitstopError as e:
        _fail(e)


def _given(**flags: Any) -> dict[str, Any]:
    """The flags an operator actually gave: only these override the environment (PITSTOP_*),
    which overrides the defaults.  A flag given its default value by the command line itself
    would silently beat the environment (PITSTOP_AGENT_SPARE=true once left a host active)."""
    return {k: v for k, v in flags.items() if v is not None}


@app.command()
def agent(
    name: Optional[str] = typer.Option(None, help="this host's name in the cluster (PITSTOP_AGENT_NAME; "
                                       "default: the host name)"),
    listen: Optional[str] = typer.Option(None, help="HOST:PORT for peers and the coordinator "
                                         "(PITSTOP_AGENT_LISTEN; default 127.0.0.1:7070)"),
    coordinator: Optional[str] = typer.Option(None, envvar="PITSTOP_COORDINATOR", help="coordinator URL"),
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
    log_json: bool = typer.Option(False, "--log-json"),
) -> None:
    """Run the host agent."""
    from pitstop.agent.server import serve
    from pitstop.agent.settings import AgentSettings

    _logs(log_json)
    kw = _given(name=name, listen=listen, coordinator=coordinator, state_dir=state_dir, image_dir=image_dir,
                advertise_url=advertise_url, spare=spare, insecure=insecure, worker_link=worker_link,
                slurm_node=slurm_node)
    try:
        serve(_settings(AgentSettings, **kw))
    except PitstopError as e:
        _fail(e)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    job: str = typer.Option(..., help="job id shared by all ranks of the job"),
    agent_url: str = typer.Option(os.environ.get("PITSTOP_AGENT", "http://127.0.0.1:7070"), "--agent",
                                  help="this host's agent (http://HOST:PORT or unix:/path)"),
    rank: Optional[int] = typer.Option(None, help="rank of this process tree (default: $RANK, else $GROUP_RANK, "
                                      "else $SLURM_PROCID under srun, else 0)"),
    host_nccl: bool = typer.Option(False, "--host-nccl", help="use pitstop's host NCCL (TCP, CPU) as libnccl.so.2"),
    no_shim: bool = typer.Option(False, "--no-shim", help="do not preload the NCCL shim"),
    address: Optional[str] = typer.Option(None, help="give the worker its own address A.B.C.D/P on the host's "
                                          "uplink subnet: its TCP connections then survive a move to any host "
                                          "on that segment"),
) -> None:
    """Run COMMAND so that pitstop can move it: pitstop run --job J --agent URL -- COMMAND [ARGS...]"""
    from pitstop.launcher.run import run as run_cmd

    args = list(ctx.args)
    if args and args[0] == "--":
        args = args[1:]
    raise typer.Exit(run_cmd(args, job=job, agent_url=agent_url, rank=rank, shim=not no_shim,
                             host_nccl=host_nccl, address=address))


@app.command()
def coordinator(
    listen: Optional[str] = typer.Option(None, help="HOST:PORT for operators and agents "
                                         "(PITSTOP_COORDINATOR_LISTEN; default 127.0.0.1:7000)"),
    db: Optional[Path] = typer.Option(None, help="SQLite database file (PITSTOP_COORDINATOR_DB; "
                                      "default /var/lib/pitstop/coordinator.db)"),
    insecure: Optional[bool] = typer.Option(None, "--insecure", help="allow running without tokens "
                                            "(PITSTOP_COORDINATOR_INSECURE)", show_default=False),
    log_json: bool = typer.Option(False, "--log-json"),
) -> None:
    """Run the coordinator (operator REST API, migration driver)."""
    from pitstop.coordinator.server import serve
    from pitstop.coordinator.settings import CoordinatorSettings

    _logs(log_json)
    try:
        serve(_settings(CoordinatorSettings, **_given(listen=listen, db=db, insecure=insecure)))
    except PitstopError as e:
        _fail(e)


def _coordinator_option() -> Any:
    return typer.Option(None, "--coordinator", envvar="PITSTOP_COORDINATOR", show_envvar=True,
                        help="the coordinator's URL, http(s)://HOST:PORT")


def _client(url: str | None, as_json: bool = False):  # noqa: ANN202
    """The coordinator's client; a missing or malformed URL is said plainly, not raised."""
    from pitstop.wire.coordinator_client import CoordinatorClient

    try:
        return CoordinatorClient(url)
    except PitstopError as e:
        _fail(e, as_json)


def _ask(coordinator: str | None, as_json: bool, call: Callable[[Any], Any]) -> Any:
    """One call to the coordinator: its answer, or the error said plainly (exit 1).  With --json
    the answer is printed here and None returned: the caller has nothing left to show."""
    c = _client(coordinator, as_json)
    try:
        data = call(c)
    except PitstopError as e:
        _fail(e, as_json)
    if as_json:
        print(json.dumps(data, indent=1))
        return None
    return data


def _age(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.0f}m"


hosts_app = typer.Typer(invoke_without_command=True, help="List hosts (role, health, GPUs, last heartbeat); "
                        "return an evacuated host to service, change a role, forget a host that is gone.")
app.add_typer(hosts_app, name="hosts")


@hosts_app.callback()
def hosts(ctx: typer.Context, as_json: bool = typer.Option(False, "--json"),
          coordinator: Optional[str] = _coordinator_option()) -> None:
    """List hosts: role, health, GPUs, last heartbeat."""
    if ctx.invoked_subcommand:
        return
    hs = _ask(coordinator, as_json, lambda c: c.hosts())
    if hs is None:
        return
    t = Table(title="hosts")
    for c in ("name", "role", "url", "gpus", "health", "last heartbeat"):
        t.add_column(c)
    for h in hs:
        gpus = f"{h.get('gpu_count')} x {h.get('gpu_model')}" if h.get("gpu_count") else \
            (h.get("gpu_note") or "not present")
        temps = [g["temperature_c"] for g in h.get("gpu_health") or [] if g.get("temperature_c") is not None]
        if temps:
            gpus += f", {max(temps)} C max"
        health = h.get("health") or {}
        status = "degraded: " + "; ".join(health.get("reasons", [])) if health.get("degraded") else "ok"
        auto = h.get("auto_evacuation")
        if auto:
            status += f"\nauto-evacuation {auto.get('state')}" + (
                f" ({auto['operation']})" if auto.get("operation") else
                f": {auto['error']['message']}" if auto.get("error") else "")
        t.add_row(h["name"], h["role"], h["url"], gpus, status, _age(h["age_s"]) + " ago")
    out.print(t)


def _host_verb(call: str, name: str, as_json: bool, coordinator: Optional[str], *args: str) -> None:
    h = _ask(coordinator, as_json, lambda c: getattr(c, call)(name, *args))
    if h is None:
        return
    if h.get("removed"):
        out.print(f"{name} forgotten")
    else:
        out.print(f"{name} is {h['role']}")


@hosts_app.command("uncordon")
def hosts_uncordon(name: str = typer.Argument(..., help="an evacuated (drained) host"),
                   as_json: bool = typer.Option(False, "--json"),
                   coordinator: Optional[str] = _coordinator_option()) -> None:
    """Return an evacuated host to service: a spare again if its agent runs with --spare, else active.
    Until then it is never a destination."""
    _host_verb("uncordon", name, as_json, coordinator)


@hosts_app.command("set-role")
def hosts_set_role(name: str = typer.Argument(..., help="a host in service"),
                   role: str = typer.Argument(..., help="spare (takes evacuated workers) or active"),
                   as_json: bool = typer.Option(False, "--json"),
                   coordinator: Optional[str] = _coordinator_option()) -> None:
    """Make a host in service a spare, or active."""
    if role not in ("spare", "active"):
        _fail(InvalidRequest(f"role {role!r} is not spare or active", action="pass spare or active"), as_json)
    _host_verb("set_role", name, as_json, coordinator, role)


@hosts_app.command("remove")
def hosts_remove(name: str = typer.Argument(..., help="a host whose agent is gone"),
                 as_json: bool = typer.Option(False, "--json"),
                 coordinator: Optional[str] = _coordinator_option()) -> None:
    """Forget a host that is gone (its agent silent past the heartbeat timeout, no live workers)."""
    _host_verb("remove_host", name, as_json, coordinator)


@app.command()
def jobs(as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = _coordinator_option()) -> None:
    """List jobs and where their workers run."""
    js = _ask(coordinator, as_json, lambda c: c.jobs())
    if js is None:
        return
    t = Table(title="jobs")
    for c in ("job", "state", "movable", "workers (rank@host: state)"):
        t.add_column(c)
    for j in js:
        why = next((w["unmovable"] for w in j["workers"] if w.get("unmovable")), None)
        t.add_row(j["job"], j["state"], "yes" if j.get("movable", True) else f"no, because {why}",
                  ", ".join(f"{w['rank']}@{w['host']}: {w['state']}" for w in j["workers"]))
    out.print(t)


def _signal_job(job: str, sig: int, wait: bool, timeout: float, as_json: bool, coordinator: Optional[str]) -> None:
    """Signal every rank of a job where it runs now; with --wait, until none runs."""
    import time

    c = _client(coordinator, as_json)
    try:
        r = c.signal_job(job, sig)
        end = time.monotonic() + timeout
        running = wait
        while running:
            running = any(j["job"] == job and j["state"] == "running" for j in c.jobs())
            if not running or time.monotonic() >= end:
                break
            time.sleep(0.5)
    except PitstopError as e:
        _fail(e, as_json)
    failed = [w for w in r["workers"] if w.get("error")]
    if as_json:
        print(json.dumps(r | {"running": running}, indent=1))
    else:
        for w in r["workers"]:
            said = "signalled" if w["delivered"] else w.get("error") or "no longer running"
            out.print(f"{w['worker']}@{w['host']}: {said}")
        if wait and not running:
            out.print(f"job {job} has no running rank left")
    if failed:
        err.print(f"[red]{len(failed)} rank(s) not signalled[/]: send it again (a rank in the middle of a move "
                  "is signalled once the move has ended)")
        raise typer.Exit(1)
    if wait and running:
        err.print(f"[yellow]job {job} still runs after {timeout:.0f} s[/]; `pitstop kill {job}` ends it")
        raise typer.Exit(EXIT_STILL_RUNNING)


@app.command()
def attach(worker: str = typer.Argument(..., help="a worker, JOB.RANK (as `pitstop jobs` lists them)"),
           coordinator: Optional[str] = _coordinator_option()) -> None:
    """Follow a worker's output wherever it runs, and exit with its status: the job's handle for
    whoever lost its launcher (the host it was started on went away after an evacuation)."""
    from pitstop.launcher.run import follow, shell_code

    c = _client(coordinator)
    try:
        c.output(worker, "stdout", 0)  # an unknown worker is said plainly, before any following
    except PitstopError as e:
        _fail(e)
    raise typer.Exit(shell_code(follow(c, worker)))


@app.command()
def stop(job: str = typer.Argument(..., help="the job (as `pitstop jobs` lists it)"),
         signal_name: str = typer.Option("TERM", "--signal", help="the signal, by name or number"),
         wait: bool = typer.Option(False, "--wait", help="wait until no rank of the job runs"),
         timeout: float = typer.Option(60.0, min=0, help="seconds to wait with --wait"),
         as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = _coordinator_option()) -> None:
    """Send SIGTERM (or --signal) to every rank of a job, wherever each runs now, moved ranks
    included: what a scheduler's cancel does to the ranks it still knows."""
    from pitstop.proc import signals

    try:
        sig = signals.parse(signal_name)
    except ValueError as e:
        err.print(f"[red]--signal: {e}[/]")
        raise typer.Exit(2) from None
    _signal_job(job, sig, wait, timeout, as_json, coordinator)


@app.command()
def kill(job: str = typer.Argument(..., help="the job (as `pitstop jobs` lists it)"),
         wait: bool = typer.Option(False, "--wait", help="wait until no rank of the job runs"),
         timeout: float = typer.Option(60.0, min=0, help="seconds to wait with --wait"),
         as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = _coordinator_option()) -> None:
    """SIGKILL every rank of a job, wherever each runs now."""
    import signal

    _signal_job(job, signal.SIGKILL, wait, timeout, as_json, coordinator)


@app.command()
def ops(op_id: Optional[str] = typer.Argument(None, help="an operation id; omit to list them"),
        node: Optional[str] = typer.Option(None, "--node", help="only operations from or to this host"),
        running: Optional[bool] = typer.Option(None, "--running/--finished", help="only running, or finished, ones",
                                               show_default=False),
        limit: int = typer.Option(50, "--limit", min=1, max=1000, help="the newest this many"),
        before: Optional[float] = typer.Option(None, "--before", help="the page before this creation time "
                                               "(the oldest `created` of the last page, from --json)"),
        as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = _coordinator_option()) -> None:
    """List operations (the newest, filtered), or show one."""
    data = _ask(coordinator, as_json, lambda c: c.op(op_id) if op_id else c.ops(
        node=node, done=None if running is None else not running, before=before, limit=limit))
    if data is None:
        return
    if op_id:
        _print_op(data)
        return
    t = Table(title="operations")
    for c in ("operation", "node", "to", "phase", "result", "downtime", "why", "by"):
        t.add_column(c)
    for o in data:
        m = o["metadata"]
        t.add_row(o["name"], m["node"], m["destination"], m["phase"], m.get("result") or "running",
                  f"{m['downtime_s']:.2f}s" if m.get("downtime_s") is not None else "", m.get("reason") or "",
                  m.get("requested_by") or "")
    out.print(t)
    if len(data) == limit:
        err.print(f"the newest {limit} shown; older ones: --before {min(o['metadata']['create_time'] for o in data)}")


@app.command()
def moves(node: Optional[str] = typer.Option(None, "--node", help="only moves from or to this host"),
          result: Optional[str] = typer.Option(None, "--result", help="succeeded, failed or cancelled"),
          limit: int = typer.Option(50, "--limit", min=1, max=1000),
          as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = _coordinator_option()) -> None:
    """The ledger of finished moves: why, where to, bytes, the pause, and the job's time to useful
    progress after it (first collectives, back to speed, step time after over before)."""
    data = _ask(coordinator, as_json, lambda c: c.moves(node=node, result=result, limit=limit))
    if data is None:
        return
    t = Table(title="moves")
    for col in ("operation", "from -> to", "result", "pause", "bytes before / in pause", "first collectives",
                "back to speed", "step time after/before", "why"):
        t.add_column(col)

    def s(v: Any, unit: str = " s") -> str:
        return "" if v is None else f"{v:.2f}{unit}"

    for m in data:
        a = m.get("after_move") or {}
        t.add_row(m["operation"].removeprefix("operations/"), f"{m['decision']['node']} -> {m['decision']['destination']}",
                  m["result"] or "", s(m["pause_s"]),
                  f"{m['bytes']['before_pause'] / 2**20:.0f} / {(m['bytes']['during_pause'] or 0) / 2**20:.0f} MiB",
                  s(a.get("first_collectives_s")) if a.get("measured") else ("not measured" if a else "watching"),
                  s(a.get("back_to_speed_s")), s(a.get("step_time_ratio"), " x"), m["why"]["reason"])
    out.print(t)


@app.command()
def cancel(op_id: str = typer.Argument(..., help="the operation to cancel (as `pitstop ops` lists it)"),
           wait: bool = typer.Option(False, "--wait", help="wait until it has rolled back"),
           timeout: float = typer.Option(300.0, min=0, help="seconds to wait with --wait"),
           as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = _coordinator_option()) -> None:
    """Cancel an evacuation before its commit point: it rolls back and every worker keeps running
    where it was.  Past the commit point it is refused (the move finishes)."""
    import time

    c = _client(coordinator, as_json)
    try:
        o = c.cancel(op_id)
        end = time.monotonic() + timeout
        while wait and not o["done"] and time.monotonic() < end:
            time.sleep(0.2)
            o = c.op(o["name"])
    except PitstopError as e:
        _fail(e, as_json)
    if as_json:
        print(json.dumps(o, indent=1))
    elif o["done"]:
        _print_op(o)
    else:
        out.print(f"cancelling {o['name']} (phase {o['metadata']['phase']}): it rolls back; "
                  f"follow with `pitstop ops {o['name']}`")
    if wait and not o["done"]:
        err.print(f"[yellow]still rolling back after {timeout:.0f} s; follow with `pitstop ops {o['name']}`[/]")
        raise typer.Exit(EXIT_STILL_RUNNING)


def _print_op(o: dict) -> None:
    m = o["metadata"]
    t = Table(title=f"{o['name']}: {m['node']} -> {m['destination']} ({m.get('result') or m['phase']})")
    t.add_column("phase")
    t.add_column("seconds", justify="right")
    outside = {"precopy": "precopy (before the pause)", "cleanup": "cleanup (after the resume)",
               "fill": "fill (after the resume)"}
    for k, v in m.get("phases", {}).items():
        t.add_row(outside.get(k, k), f"{v:.3f}")
    if m.get("downtime_s") is not None:
        t.add_row("[bold]downtime (first pause -> last resume)[/]", f"[bold]{m['downtime_s']:.3f}[/]")
    if m.get("pre_copy_bytes"):
        t.add_row("bytes sent ahead, while the job ran (pre-copy; phase precopy, before the pause)",
                  f"{m['pre_copy_bytes']:,}")
    if m.get("bytes_total"):
        t.add_row("bytes moved during the pause" if m.get("pre_copy_bytes") else "bytes moved",
                  f"{m['bytes_total']:,}")
        if m.get("bytes_after_resume"):
            t.add_row("bytes fetched after the resume (network post-copy)", f"{m['bytes_after_resume']:,}")
            if m.get("fill_s") is not None:
                t.add_row(f"memory all on {m['destination']} (after the resume; {m['node']} may leave)",
                          f"{m['fill_s']:.3f}")
    out.print(t)
    if o.get("error"):
        how = "cancelled" if m.get("result") == "cancelled" else "failed"
        err.print(f"[bold red]{how}:[/] {o['error']['message']}", soft_wrap=True)
        for d in o["error"].get("details", []):
            if d.get("action"):
                err.print(f"[bold]what to do:[/] {d['action']}", soft_wrap=True)


@app.command()
def evacuate(
    node: str = typer.Argument(..., help="the host to drain"),
    to: Optional[str] = typer.Option(None, "--to", help="destination host (default: a compatible spare)"),
    wait: bool = typer.Option(False, "--wait", help="wait for the operation to finish"),
    as_json: bool = typer.Option(False, "--json", help="print the (final) Operation as JSON"),
    idempotency_key: Optional[str] = typer.Option(None, "--idempotency-key", help="retry-safe request key"),
    timeout: float = typer.Option(900.0, min=0, help="seconds to wait with --wait"),
    post_copy: Optional[bool] = typer.Option(
        None, "--post-copy/--no-post-copy",
        help="network post-copy: the job resumes before most of the moved memory has travelled; it follows "
             "from NODE, which must stay up until the operation is done.  Default: the source agent's "
             "PITSTOP_AGENT_REMOTE_POST_COPY"),
    pre_copy: Optional[bool] = typer.Option(
        None, "--pre-copy/--no-pre-copy",
        help="send the leaving workers' memory while the job still runs, then only what changed during the "
             "pause.  Default: the coordinator's PITSTOP_COORDINATOR_PRE_COPY"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="make every check an evacuation makes before anything pauses (the spare it "
                                 "would get, post-copy support, the spare's files) and say what would move; "
                                 "moves nothing"),
    reason: Optional[str] = typer.Option(None, "--reason", help="why NODE must leave; kept with the operation "
                                         "(`pitstop ops` shows it)"),
    coordinator: Optional[str] = _coordinator_option(),
) -> None:
    """Move every worker off NODE to a spare while its jobs keep training.

    Done when NODE may leave: with post-copy, once the moved memory has all arrived."""
    import time

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    c = _client(coordinator, as_json)
    try:
        o = c.evacuate(node, to, idempotency_key, reason=reason, post_copy=post_copy, pre_copy=pre_copy,
                       validate_only=dry_run)
    except PitstopError as e:
        _fail(e, as_json)
    if dry_run:
        if as_json:
            print(json.dumps(o, indent=1))
            return
        out.print(f"{node} could be evacuated now: {len(o['workers'])} worker(s) of {', '.join(o['jobs'])} "
                  f"would move to {o['destination']}" + (f", {len(o['peers'])} peer(s) pausing meanwhile"
                                                         if o["peers"] else ""))
        if o["files"]["unchecked"]:
            out.print(f"not checked: the files of {', '.join(o['files']['unchecked'])} (an agent predates the "
                      "check; the restore would say what is missing)")
        else:
            out.print(f"{o['destination']} has every file the leaving workers use")
        return
    if not wait:
        print(json.dumps(o, indent=1)) if as_json else out.print(f"started {o['name']}")
        return
    end = time.monotonic() + timeout
    show = not as_json and err.is_terminal or os.environ.get("PITSTOP_PROGRESS") == "1"
    with Progress(TextColumn("[bold]{task.fields[phase]:<9}"), BarColumn(), DownloadColumn(),
                  TimeElapsedColumn(), console=err, disable=not show, transient=False) as prog:
        task = prog.add_task("evacuate", total=None, phase="pending")
        last: tuple[str, int] | None = None
        last_line = 0.0
        while True:
            try:
                o = c.op(o["name"])
            except PitstopError as e:
                _fail(e, as_json)
            m = o["metadata"]
            done, total = _progress(m)
            prog.update(task, phase=m["phase"], completed=done, total=total)
            # without a terminal: a line per phase, and one every 10 s while the bytes move
            if not show and not as_json and (last is None or m["phase"] != last[0]
                                             or (done != last[1] and time.monotonic() - last_line >= 10)):
                of = " of about" if m["phase"] == "precopy" else " of"  # a pre-copy's total is an estimate
                err.print(f"phase: {m['phase']}  bytes: {done:,}" + (f"{of} {total:,}" if total else ""))
                last, last_line = (m["phase"], done), time.monotonic()
            if o["done"] or time.monotonic() > end:
                break
            time.sleep(0.2)
    if as_json:
        print(json.dumps(o, indent=1))
    else:
        _print_op(o)
    if not o["done"]:
        err.print(f"[yellow]still running after {timeout:.0f} s; follow with `pitstop ops {o['name']}`[/]")
        raise typer.Exit(EXIT_STILL_RUNNING)
    if o.get("error"):
        raise typer.Exit(1)


def _progress(m: dict) -> tuple[int, int | None]:
    """Bytes done and expected in the operation's current phase: the pre-copy's own while it
    runs (memory sent while the job trains), otherwise those moved during the pause."""
    if m.get("phase") == "precopy":
        return int(m.get("pre_copy_bytes") or 0), m.get("pre_copy_bytes_total") or None
    return int(m.get("bytes_done") or 0), m.get("bytes_total") or None


@app.command("slurm-watch")
def slurm_watch(
    coordinator: Optional[str] = _coordinator_option(),
    reason_prefix: str = typer.Option("", "--reason-prefix", envvar="PITSTOP_SLURM_REASON_PREFIX",
                                      help="act only on drains whose reason starts with this (default: every drain)"),
    reservation: str = typer.Option("pitstop_spares", "--reservation", envvar="PITSTOP_SLURM_RESERVATION",
                                    help="the Slurm reservation that keeps ordinary jobs off the spares "
                                         "('' to manage none)"),
    interval: float = typer.Option(1.0, "--interval", min=0.1, max=60.0, help="seconds between looks"),
    log_json: bool = typer.Option(False, "--log-json"),
) -> None:
    """Move the ranks off Slurm nodes as they are drained, hold the spares back from Slurm's
    other jobs, and drain in Slurm the hosts pitstop finds degraded.  One per cluster; reads Slurm
    through its usual client configuration (SLURM_CONF), the coordinator with PITSTOP_TOKEN."""
    import signal as signals

    from pitstop.slurm.watch import SlurmCommands, Watcher

    _logs(log_json)
    c = _client(coordinator)
    stop: list[int] = []
    for sig in (signals.SIGTERM, signals.SIGINT):
        signals.signal(sig, lambda n, _f: stop.append(n))
    Watcher(SlurmCommands(), c, reason_prefix=reason_prefix, reservation=reservation or None).run(
        interval, until=lambda: bool(stop))


@app.command()
def replay(
    trace_file: Path = typer.Argument(..., help="the failure and maintenance history: CSV or JSON with "
                                      "time_h, host, kind (planned|unplanned), domain"),
    hosts: int = typer.Option(..., min=1, help="hosts the job runs on"),
    gpus_per_host: int = typer.Option(8, min=1),
    spares_per_domain: int = typer.Option(0, min=0, help="spares held in each failure domain"),
    pooled_spares: int = typer.Option(1, min=0, help="spares held for any domain"),
    repair_h: float = typer.Option(24.0, min=0, help="hours until a used spare is back (the host repaired)"),
    move_pause_s: Optional[float] = typer.Option(None, min=0, help="pitstop's pause for one host's move "
                                                 "(default: --moves-from's median, else bench/projection.py's "
                                                 "199 s for a 1,024-GPU job)"),
    moves_from: Optional[str] = typer.Option(None, help="a coordinator URL: the median pause of its succeeded "
                                             "evacuations is the move pause (PITSTOP_TOKEN)"),
    restart_s: float = typer.Option(90.0, min=0, help="checkpoint-restart: relaunch, NCCL init and load"),
    checkpoint_save_s: float = typer.Option(10.0, min=0, help="the job's pause for one checkpoint"),
    checkpoint_interval_h: float = typer.Option(1.0, min=0.001, help="hours between the job's checkpoints"),
    duration_h: Optional[float] = typer.Option(None, min=0, help="the trace's span (default: its last event)"),
    as_json: bool = typer.Option(False, "--json"),
    chart: Optional[Path] = typer.Option(None, help="also write an SVG chart here"),
) -> None:
    """Price a failure history: GPU-hours lost with pitstop and with checkpoint-restart, what is
    common to both (checkpoints, idle spares), the sensitivity to each input, and each failure
    domain's coverage by its spares."""
    from pitstop.replay import model, report, trace

    try:
        events = trace.read(trace_file)
        source = str(trace_file)
        pause = move_pause_s
        if pause is None and moves_from:
            from pitstop.wire.coordinator_client import CoordinatorClient

            with CoordinatorClient(moves_from) as c:
                pause = model.median_move_pause_s(c.ops(done=True, limit=1000))
            if pause is None:
                raise PitstopError(f"the coordinator at {moves_from} has no succeeded evacuation to measure",
                                   code="no_moves", action="give --move-pause-s")
            source += f"; move pause: the median of {moves_from}'s succeeded evacuations ({pause:.2f} s)"
        i = model.Inputs(hosts=hosts, gpus_per_host=gpus_per_host, spares_per_domain=spares_per_domain,
                         pooled_spares=pooled_spares, repair_h=repair_h,
                         move_pause_s=model.DEFAULT_MOVE_PAUSE_S if pause is None else pause,
                         restart_s=restart_s, checkpoint_save_s=checkpoint_save_s,
                         checkpoint_interval_h=checkpoint_interval_h, duration_h=duration_h)
        r = model.replay(events, i)
        sens = model.sensitivity(events, i)
    except PitstopError as e:
        _fail(e, as_json)
    if chart:
        chart.write_text(report.svg(r, sens))
    if as_json:
        print(json.dumps(report.as_dict(r, sens), indent=1))
    else:
        print(report.markdown(r, sens, source), end="")


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
        _fail(e)
    trace.write(events, out_file)
    planned = sum(1 for e in events if e.kind == "planned")
    err.print(f"{len(events)} events ({planned} planned, {len(events) - planned} unplanned) over {days:g} days "
              f"on {hosts} hosts written to {out_file}")


pki = typer.Typer(no_args_is_help=True, help="A private CA for mutual TLS between pitstop's services.")
app.add_typer(pki, name="pki")


@pki.command("init")
def pki_init(directory: Path = typer.Argument(..., help="where the CA's ca.pem and ca.key go (keep ca.key offline)")) -> None:
    """Create the cluster's CA."""
    from pitstop import tls

    try:
        print(tls.init_ca(directory))
    except PitstopError as e:
        _fail(e)
    except OSError as e:
        _fail(_cannot_write(directory, e))


def _cannot_write(directory: Path, e: OSError) -> PitstopError:
    return InvalidRequest(f"cannot write in {directory}: {e.strerror} ({e.filename})", code="pki_directory",
                          action="give a directory on a writable file system, e.g. /etc/pitstop/ca")


@pki.command("issue")
def pki_issue(directory: Path = typer.Argument(..., help="the CA's directory"),
              name: str = typer.Argument(..., help="host, coordinator or operator name (the certificate's CN)"),
              role: str = typer.Option(..., "--role", help="agent (a GPU host), coordinator or operator: "
                                                          "each server admits only the roles its endpoints are for"),
              san: list[str] = typer.Option([], "--san", help="a DNS name or IP address peers use for it (repeat)"),
              days: int = typer.Option(365, min=1, max=3650)) -> None:
    """Issue NAME.pem and NAME.key; point PITSTOP_TLS_CA/CERT/KEY at them on that host."""
    from pitstop import tls
    from pitstop.endpoints import check_host_name

    try:
        check_host_name(name)
    except ValueError as e:
        _fail(InvalidRequest(f"certificate name: {e}",
                             action="it is also the file name NAME.pem: use the host's or the person's short name"))
    try:
        crt, key = tls.issue(directory, name, san, days, role=role)
    except PitstopError as e:
        _fail(e)
    except OSError as e:
        _fail(_cannot_write(directory, e))
    print(f"PITSTOP_TLS_CA={directory / 'ca.pem'}\nPITSTOP_TLS_CERT={crt}\nPITSTOP_TLS_KEY={key}")


def main() -> None:
    try:
        app()
    except PitstopError as e:  # anything a command did not turn into a message itself
        err.print(f"[bold red]error:[/] {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()

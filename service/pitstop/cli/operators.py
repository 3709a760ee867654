"""The operator's commands against the coordinator: hosts, jobs, evacuations and their ledger,
and the job's handle (attach, stop, kill)."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Optional

import typer
from rich.table import Table

from pitstop.cli.common import (
    EXIT_STILL_RUNNING,
    age,
    app,
    ask,
    client,
    coordinator_option,
    err,
    fail,
    out,
    until_done,
)
from pitstop.errors import InvalidRequest, PitstopError

if TYPE_CHECKING:
    from pitstop.wire.coordinator_client import CoordinatorClient

hosts_app = typer.Typer(invoke_without_command=True, help="List hosts (role, health, GPUs, last heartbeat); "
                        "cordon a host, return a cordoned or evacuated host to service, change a role, "
                        "forget a host that is gone.")
app.add_typer(hosts_app, name="hosts")


@hosts_app.callback()
def hosts(ctx: typer.Context, as_json: bool = typer.Option(False, "--json"),
          coordinator: Optional[str] = coordinator_option()) -> None:
    """List hosts: role (for a drained or cordoned host since when and why), live workers, health, GPUs,
    last heartbeat."""
    if ctx.invoked_subcommand:
        return
    hs = ask(coordinator, as_json, lambda c: c.hosts())
    if hs is None:
        return
    t = Table(title="hosts")
    for c in ("name", "role", "workers", "url", "gpus", "health", "last heartbeat"):
        t.add_column(c)
    for h in hs:
        gpus = f"{h.get('gpu_count')} x {h.get('gpu_model')}" if h.get("gpu_count") else \
            (h.get("gpu_note") or "not present")
        temps = [g["temperature_c"] for g in h.get("gpu_health") or [] if g.get("temperature_c") is not None]
        if temps:
            gpus += f", {max(temps)} C max"
        health = h.get("health") or {}
        status = "degraded: " + "; ".join(health.get("reasons", [])) if health.get("degraded") else "ok"
        if h.get("silent"):
            status = f"[red]silent[/] for {age(h['age_s'])} (taken for failed)"
        auto = h.get("auto_evacuation")
        if auto:
            status += f"\nauto-evacuation {auto.get('state')}" + (
                f" ({auto['operation']})" if auto.get("operation") else
                f": {auto['error']['message']}" if auto.get("error") else "")
        t.add_row(h["name"], _role(h), str(h.get("live_workers", "?")), h["url"], gpus, status, age(h["age_s"]) + " ago")
    out.print(t)


def _role(h: dict[str, Any]) -> str:
    """The role; for a host out of service since when and why (its evacuation's reason and operation);
    and whether an operator keeps the host out of the spare pool."""
    s = h["role"]
    why, since = h.get("role_why") or {}, h.get("role_since")
    if h["role"] in ("draining", "drained"):
        if since:
            s += f" for {age(time.time() - since)}"
        if why.get("reason"):
            s += f": {why['reason']}"
        if why.get("operation"):
            s += f" ({why['operation']})"
    c = h.get("cordoned")
    if c:
        s += f", cordoned for {age(time.time() - c['since'])}" if c.get("since") else ", cordoned"
        s += f": {c.get('reason') or 'no reason given'}"
    return s


def _host_verb(call: str, name: str, as_json: bool, coordinator: Optional[str], *args: Any) -> None:
    h = ask(coordinator, as_json, lambda c: getattr(c, call)(name, *args))
    if h is None:
        return
    if h.get("removed"):
        out.print(f"{name} forgotten")
    else:
        out.print(f"{name} is {_role(h)}", soft_wrap=True)


@hosts_app.command("cordon")
def hosts_cordon(name: str = typer.Argument(..., help="a host to keep out of the spare pool"),
                 reason: Optional[str] = typer.Option(None, "--reason", help="why (kept with the host, shown by "
                                                      "`pitstop hosts`)"),
                 as_json: bool = typer.Option(False, "--json"),
                 coordinator: Optional[str] = coordinator_option()) -> None:
    """Keep a host out of the spare pool, moving nothing: it is never the destination of an evacuation
    or a recovery until `pitstop hosts uncordon`. Its workers keep running (evacuate it to move them)."""
    _host_verb("cordon", name, as_json, coordinator, reason)


@hosts_app.command("uncordon")
def hosts_uncordon(name: str = typer.Argument(..., help="a cordoned or evacuated (drained) host"),
                   as_json: bool = typer.Option(False, "--json"),
                   coordinator: Optional[str] = coordinator_option()) -> None:
    """Let a cordoned host back into the spare pool; return an evacuated host to service: a spare
    again if its agent runs with --spare, else active. Until then it is never a destination."""
    _host_verb("uncordon", name, as_json, coordinator)


@hosts_app.command("set-role")
def hosts_set_role(name: str = typer.Argument(..., help="a host in service"),
                   role: str = typer.Argument(..., help="spare (takes evacuated workers) or active"),
                   as_json: bool = typer.Option(False, "--json"),
                   coordinator: Optional[str] = coordinator_option()) -> None:
    """Make a host in service a spare, or active."""
    if role not in ("spare", "active"):
        fail(InvalidRequest(f"role {role!r} is not spare or active", action="pass spare or active"), as_json)
    _host_verb("set_role", name, as_json, coordinator, role)


@hosts_app.command("remove")
def hosts_remove(name: str = typer.Argument(..., help="a host whose agent is gone"),
                 as_json: bool = typer.Option(False, "--json"),
                 coordinator: Optional[str] = coordinator_option()) -> None:
    """Forget a host that is gone (its agent silent past the heartbeat timeout, no live workers)."""
    _host_verb("remove_host", name, as_json, coordinator)


@app.command()
def jobs(as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = coordinator_option()) -> None:
    """List jobs and where their workers run."""
    js = ask(coordinator, as_json, lambda c: c.jobs())
    if js is None:
        return
    t = Table(title="jobs")
    for c in ("job", "state", "movable", "protected", "workers (rank@host: state)"):
        t.add_column(c)
    for j in js:
        why = next((w["unmovable"] for w in j["workers"] if w.get("unmovable")), None)
        t.add_row(j["job"], j["state"], "yes" if j.get("movable", True) else f"no, because {why}",
                  _protection(j.get("protection")),
                  ", ".join(f"{w['rank']}@{w['host']}: {_worker_state(w)}" for w in j["workers"]))
    out.print(t)


def _worker_state(w: dict) -> str:
    """A rank's state as `pitstop jobs` shows it: a running rank whose NCCL shim holds a peer's failure
    back for the job's recovery says so."""
    return w["state"] + (" (parked: a peer failed)" if (w.get("peer_lost") or "").startswith("parked") else "")


def _protection(p: dict | None) -> str:
    """Whether a running job that asked for snapshots would be recovered from one now."""
    if p is None:
        return "-"
    if p["protected"]:
        return f"yes (snapshot {p['snapshot']}, {p['age_s']:.0f} s old)" + (
            f"; {p['stretched']}" if p.get("stretched") else "")
    return f"[red]no[/], because {p['why_not']}"


def _signal_job(job: str, sig: int, wait: bool, timeout: float, as_json: bool, coordinator: Optional[str]) -> None:
    """Signal every rank of a job where it runs now; with --wait, until none runs."""
    import signal
    import time

    c = client(coordinator, as_json)
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
        fail(e, as_json)
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
        if sig == signal.SIGKILL:  # nothing stronger to advise: say where to look instead
            err.print(f"[yellow]job {job} still reads running {timeout:.0f} s after SIGKILL[/]: `pitstop jobs` "
                      "shows which ranks and where; a rank on a host that stopped answering reads running until "
                      "the host is heard again or its job is recovered (`pitstop hosts` says which host is silent); "
                      "for one whose host answers, look at that host (`pitstop ops --running` for a move under way)",
                      soft_wrap=True)
        else:
            err.print(f"[yellow]job {job} still runs after {timeout:.0f} s[/]; `pitstop kill {job}` ends it")
        raise typer.Exit(EXIT_STILL_RUNNING)


@app.command()
def attach(worker: str = typer.Argument(..., help="a worker, JOB.RANK (as `pitstop jobs` lists them)"),
           coordinator: Optional[str] = coordinator_option()) -> None:
    """Follow a worker's output wherever it runs, and exit with its status: the job's handle for
    whoever lost its launcher (the host it was started on went away after an evacuation)."""
    from pitstop.launcher.run import follow, shell_code

    c = client(coordinator)
    try:
        c.output(worker, "stdout", 0)  # an unknown worker is said plainly, before any following
    except PitstopError as e:
        fail(e)
    raise typer.Exit(shell_code(follow(c, worker)))


@app.command()
def stop(job: str = typer.Argument(..., help="the job (as `pitstop jobs` lists it)"),
         signal_name: str = typer.Option("TERM", "--signal", help="the signal, by name or number"),
         wait: bool = typer.Option(False, "--wait", help="wait until no rank of the job runs"),
         timeout: float = typer.Option(60.0, min=0, help="seconds to wait with --wait"),
         as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = coordinator_option()) -> None:
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
         as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = coordinator_option()) -> None:
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
        as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = coordinator_option()) -> None:
    """List operations (the newest, filtered), or show one."""
    data = ask(coordinator, as_json, lambda c: c.op(op_id) if op_id else c.ops(
        node=node, done=None if running is None else not running, before=before, limit=limit))
    if data is None:
        return
    if op_id:
        _print_op(data)
        return
    t = Table(title="operations")
    for c in ("operation", "started", "node", "to", "phase", "result", "pause", "why", "by"):
        t.add_column(c)
    for o in data:
        m = o["metadata"]
        pause = next((m[k] for k in ("job_pause_s", "downtime_s", "pause_s") if m.get(k) is not None), None)
        why = m.get("reason") or ""
        if m.get("@type", "").endswith("RecoverMetadata"):  # a recovery: what failed, and the work it redid
            why = (f"recovery of {m.get('job')} from snapshot {m.get('snapshot')}"
                   + (f"; redoes {m['lost_s']:.0f} s" if m.get("lost_s") is not None else ""))
        t.add_row(o["name"], time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.get("create_time") or 0)),
                  m["node"], m.get("destination") or "", m.get("phase") or "", m.get("result") or "running",
                  f"{pause:.2f}s" if pause is not None else "", why, m.get("requested_by") or "")
    out.print(t)
    if len(data) == limit:
        err.print(f"the newest {limit} shown; older ones: --before {min(o['metadata']['create_time'] for o in data)}")


@app.command()
def moves(node: Optional[str] = typer.Option(None, "--node", help="only moves from or to this host"),
          result: Optional[str] = typer.Option(None, "--result", help="succeeded, failed or cancelled"),
          limit: int = typer.Option(50, "--limit", min=1, max=1000),
          as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = coordinator_option()) -> None:
    """The ledger of finished moves: why, where to, bytes, the pause, and the job's time to useful
    progress after it (first collectives, first full step, back to speed, step time after over before)."""
    data = ask(coordinator, as_json, lambda c: c.moves(node=node, result=result, limit=limit))
    if data is None:
        return
    t = Table(title="moves")
    t.add_column("operation", no_wrap=True)
    for col in ("move", "pause (ranks)", "MiB before / in pause", "the job after it", "why"):
        t.add_column(col)
    for m in data:
        d = m["decision"]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m["finished"]))
        t.add_row(m["operation"].removeprefix("operations/") + f"\n{when}",
                  f"{m.get('kind', 'evacuation')}\n{d['node']} -> {d['destination']}\n{m['result'] or ''}",
                  (f"{m['pause_s']:.2f} s" if m["pause_s"] is not None else "")
                  + (f"\nto its {m['pause_until']}\n(downtime {m['downtime_s']:.2f} s)"
                     if m.get("pause_until") not in (None, "last resume") else "") + _spread(m.get("rank_pause_s")),
                  f"{m['bytes']['before_pause'] / 2**20:.0f} / {(m['bytes']['during_pause'] or 0) / 2**20:.0f}",
                  _recovery(m["recovery"]) if m.get("recovery") else _after(m.get("after_move"), m["result"]),
                  m["why"]["reason"])
    out.print(t)


def _recovery(r: dict[str, Any]) -> str:
    """What a recovery cost the job and left the cluster, one figure a line."""
    lines = [f"found after {r['detected_after_s']:.1f} s" if r.get("detected_after_s") is not None else None,
             f"snapshot {r['snapshot']} ({r['snapshot_age_s']:.0f} s old)" if r.get("snapshot_age_s") is not None
             else None,
             f"redoes {r['steps_redone']} steps" if r.get("steps_redone") is not None else
             (f"redoes {r['work_redone_s']:.0f} s of work" if r.get("work_redone_s") is not None else None),
             f"spares left: {r['spares_left']}" if r.get("spares_left") is not None else None]
    return "\n".join(x for x in lines if x)


def _after(a: dict[str, Any] | None, result: str | None = "succeeded") -> str:
    """The job's time to useful progress after a move, one figure a line."""
    if result != "succeeded":
        return "-"
    if not a:
        return "watching"
    if not a.get("measured"):
        return "not measured (no NCCL calls to count)"
    lines = [("first calls", a.get("first_collectives_s"), "s"), ("first step", a.get("first_step_s"), "s"),
             ("back to speed", a.get("back_to_speed_s"), "s"), ("step time", a.get("step_time_ratio"), "x before")]
    return "\n".join(f"{k} {v:.3f} {u}" for k, v, u in lines if v is not None)


def _spread(pauses: dict[str, float] | None) -> str:
    """The shortest and longest pause the job's ranks saw, where the ledger has them."""
    if not pauses:
        return ""
    lo, hi = min(pauses.values()), max(pauses.values())
    return f"\nranks {lo:.2f} s" if hi - lo < 0.005 else f"\nranks {lo:.2f}-{hi:.2f} s"

@app.command()
def cancel(op_id: str = typer.Argument(..., help="the operation to cancel (as `pitstop ops` lists it)"),
           wait: bool = typer.Option(False, "--wait", help="wait until it has rolled back"),
           timeout: float = typer.Option(300.0, min=0, help="seconds to wait with --wait"),
           as_json: bool = typer.Option(False, "--json"), coordinator: Optional[str] = coordinator_option()) -> None:
    """Cancel an evacuation before its commit point: it rolls back and every worker keeps running
    where it was.  Past the commit point it is refused (the move finishes)."""

    c = client(coordinator, as_json)
    try:
        o = c.cancel(op_id)
        o = until_done(c, o, wait, timeout)
    except PitstopError as e:
        fail(e, as_json)
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
    t = Table(title=f"{o['name']}: {m['node']} -> {m.get('destination') or '?'} ({m.get('result') or m['phase']})")
    t.add_column("phase")
    t.add_column("seconds", justify="right")
    outside = {"precopy": "precopy (before the pause)", "cleanup": "cleanup (after the resume)",
               "fill": "fill (after the resume)"}
    for k, v in m.get("phases", {}).items():
        t.add_row(outside.get(k, k), f"{v:.3f}")
    if m.get("downtime_s") is not None:
        t.add_row("[bold]downtime (first pause -> last resume)[/]", f"[bold]{m['downtime_s']:.3f}[/]")
    if m.get("job_pause_s") is not None and m.get("job_pause_until") != "last resume":
        t.add_row(f"[bold]the job's pause (first pause -> its {m['job_pause_until']}; post-copy)[/]",
                  f"[bold]{m['job_pause_s']:.3f}[/]")
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
             "from NODE, which must stay up until the operation is done.  Default: the coordinator's "
             "PITSTOP_COORDINATOR_POST_COPY (off)"),
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
    coordinator: Optional[str] = coordinator_option(),
) -> None:
    """Move every worker off NODE to a spare while its jobs keep training.

    Done when NODE may leave: with post-copy, once the moved memory has all arrived."""
    c = client(coordinator, as_json)
    try:
        o = c.evacuate(node, to, idempotency_key, reason=reason, post_copy=post_copy, pre_copy=pre_copy,
                       validate_only=dry_run)
    except PitstopError as e:
        fail(e, as_json)
    if dry_run:
        _print_dry_run(node, o, as_json)
        return
    if not wait:
        print(json.dumps(o, indent=1)) if as_json else out.print(f"started {o['name']}")
        return
    o = _follow(c, o, timeout, as_json)
    if as_json:
        print(json.dumps(o, indent=1))
    else:
        _print_op(o)
    if not o["done"]:
        err.print(f"[yellow]still running after {timeout:.0f} s; follow with `pitstop ops {o['name']}`[/]")
        raise typer.Exit(EXIT_STILL_RUNNING)
    if o.get("error"):
        raise typer.Exit(1)


def _print_dry_run(node: str, o: dict, as_json: bool) -> None:
    """What an evacuation of `node` would do, as its checks found (nothing was moved)."""
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


def _follow(c: CoordinatorClient, o: dict, timeout: float, as_json: bool) -> dict:
    """The operation followed until it is done or `timeout` passes: a progress bar on a terminal,
    else a line per phase (and one every 10 s while the bytes move).  Its last state."""
    import time

    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

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
                fail(e, as_json)
            m = o["metadata"]
            done, total = _progress(m)
            prog.update(task, phase=m["phase"], completed=done, total=total)
            if not show and not as_json and (last is None or m["phase"] != last[0]
                                             or (done != last[1] and time.monotonic() - last_line >= 10)):
                of = " of about" if m["phase"] == "precopy" else " of"  # a pre-copy's total is an estimate
                err.print(f"phase: {m['phase']}  bytes: {done:,}" + (f"{of} {total:,}" if total else ""))
                last, last_line = (m["phase"], done), time.monotonic()
            if o["done"] or time.monotonic() > end:
                return o
            time.sleep(0.2)


def _progress(m: dict) -> tuple[int, int | None]:
    """Bytes done and expected in the operation's current phase: the pre-copy's own while it
    runs (memory sent while the job trains), otherwise those moved during the pause."""
    if m.get("phase") == "precopy":
        return int(m.get("pre_copy_bytes") or 0), m.get("pre_copy_bytes_total") or None
    return int(m.get("bytes_done") or 0), m.get("bytes_total") or None

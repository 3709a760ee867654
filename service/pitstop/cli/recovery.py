"""The operator's commands for a job's snapshots and its recovery from a lost host."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer
from rich.table import Table

from pitstop.cli.common import EXIT_STILL_RUNNING, app, ask, client, coordinator_option, err, fail, out, until_done
from pitstop.errors import PitstopError


@app.command()
def snapshots(job: str = typer.Argument(..., help="the job (as `pitstop jobs` lists it)"),
              every: Optional[float] = typer.Option(None, "--every", metavar="SECONDS",
                                                    help="set the running job's snapshot interval (0: off)"),
              take: bool = typer.Option(False, "--take", help="take one snapshot now and wait for it"),
              drop: bool = typer.Option(False, "--drop", help="drop every snapshot of the job, on every host"),
              as_json: bool = typer.Option(False, "--json"),
              coordinator: Optional[str] = coordinator_option()) -> None:
    """A job's snapshots: its schedule, the one that counts, the last failure, why one is kept for a
    job that ended; set, take or drop them."""
    def call(c):  # noqa: ANN001, ANN202
        if drop:
            c.drop_snapshots(job)
        if every is not None:
            c.set_snapshots(job, every)
        if take:
            c.take_snapshot(job)
        return c.snapshots(job)

    data = ask(coordinator, as_json, call)
    if data is None:
        return
    every_s = data["every_s"]
    out.print(f"job {job}: " + (f"a snapshot every {every_s:g} s" if every_s else "no snapshots"))
    t = Table(title="snapshots")
    for c in ("number", "state", "taken", "pause", "bytes", "buddies", "error"):
        t.add_column(c)
    for s in data["snapshots"]:
        t.add_row(str(s["number"]), s["state"], time.strftime("%H:%M:%S", time.localtime(s["created"])),
                  f"{s['pause_s']:.2f}s" if s.get("pause_s") is not None else "",
                  f"{s.get('bytes', 0):,}", ", ".join(f"{h}->{b}" for h, b in sorted(s.get("buddies", {}).items())),
                  s.get("error") or "")
    out.print(t)
    if data.get("last_error"):
        err.print(f"[yellow]the last snapshot failed:[/] {data['last_error']}", soft_wrap=True)
    if data.get("kept"):
        out.print(f"kept: {data['kept']}", soft_wrap=True)


@app.command()
def recover(job: str = typer.Argument(..., help="the job whose host died"),
            node: Optional[str] = typer.Option(None, "--node", help="the lost host (default: the job's silent host)"),
            wait: bool = typer.Option(False, "--wait", help="wait for the operation to finish"),
            timeout: float = typer.Option(600.0, min=0, help="seconds to wait with --wait"),
            as_json: bool = typer.Option(False, "--json", help="print the (final) Operation as JSON"),
            coordinator: Optional[str] = coordinator_option()) -> None:
    """Recover JOB from its last complete snapshot: the lost host's ranks on a spare, every other rank
    rolled back to the same snapshot.  The coordinator starts this by itself when a host goes silent."""
    c = client(coordinator, as_json)
    try:
        o = c.recover(job, node)
        o = until_done(c, o, wait, timeout)
    except PitstopError as e:
        fail(e, as_json)
    if as_json:
        print(json.dumps(o, indent=1))
    else:
        m = o["metadata"]
        out.print(f"{o['name']}: job {job}, {m['node']} lost, snapshot {m['snapshot']} "
                  f"({m.get('result') or m.get('phase')})")
        for k, v in m.get("phases", {}).items():
            out.print(f"  {k:<8} {v:.3f} s")
        if m.get("pause_s") is not None:
            out.print(f"  pause {m['pause_s']:.3f} s; work redone (since the snapshot) {m.get('lost_s', 0):.1f} s")
        if o.get("error"):
            err.print(f"[bold red]failed:[/] {o['error']['message']}", soft_wrap=True)
            if o["error"].get("action"):
                err.print(f"[bold]what to do:[/] {o['error']['action']}", soft_wrap=True)
    if wait and not o["done"]:
        raise typer.Exit(EXIT_STILL_RUNNING)
    if o.get("error"):
        raise typer.Exit(1)

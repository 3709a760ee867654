"""The `pitstop` command: a thin layer over the library (as runc is over libcontainer)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from . import logs
from .errors import PitstopError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="pitstop: move training workers between hosts without stopping the job.")
err = Console(stderr=True)
out = Console()


def _fail(e: PitstopError, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps({"error": e.to_dict()}))
    else:
        err.print(f"[bold red]error:[/] {e.message}")
        if e.action:
            err.print(f"[bold]what to do:[/] {e.action}")
    raise typer.Exit(1)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="print the checks as JSON")) -> None:
    """Check whether this host can capture and restore workers."""
    from .doctor import ready, run_checks

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


@app.command()
def agent(
    name: str = typer.Option(..., help="this host's name in the cluster"),
    listen: str = typer.Option("127.0.0.1:7070", help="HOST:PORT for peers and the coordinator"),
    coordinator: Optional[str] = typer.Option(None, envvar="PITSTOP_COORDINATOR", help="coordinator URL"),
    state_dir: Path = typer.Option(Path("/var/lib/pitstop/agent"), help="where the agent keeps its state"),
    image_dir: Optional[Path] = typer.Option(None, help="where images go (default /dev/shm/pitstop/NAME)"),
    advertise_url: Optional[str] = typer.Option(None, help="URL peers use to reach this agent"),
    spare: bool = typer.Option(False, "--spare", help="offer this host as a migration target"),
    insecure: bool = typer.Option(False, "--insecure", help="allow running without PITSTOP_CLUSTER_TOKEN"),
    log_json: bool = typer.Option(False, "--log-json"),
) -> None:
    """Run the host agent."""
    from .agent.server import serve
    from .agent.settings import AgentSettings

    logs.setup(json=log_json)
    kw = dict(name=name, listen=listen, state_dir=state_dir, spare=spare, insecure=insecure)
    if coordinator:
        kw["coordinator"] = coordinator
    if image_dir:
        kw["image_dir"] = image_dir
    if advertise_url:
        kw["advertise_url"] = advertise_url
    try:
        serve(AgentSettings(**kw))
    except PitstopError as e:
        _fail(e)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(
    ctx: typer.Context,
    job: str = typer.Option(..., help="job id shared by all ranks of the job"),
    agent_url: str = typer.Option(os.environ.get("PITSTOP_AGENT", "http://127.0.0.1:7070"), "--agent",
                                  help="this host's agent (http://HOST:PORT or unix:/path)"),
    rank: Optional[int] = typer.Option(None, help="rank of this process tree (default: $RANK, else 0)"),
) -> None:
    """Run COMMAND so that pitstop can move it: pitstop run --job J --agent URL -- COMMAND [ARGS...]"""
    from .launcher.run import run as run_cmd

    args = list(ctx.args)
    if args and args[0] == "--":
        args = args[1:]
    raise typer.Exit(run_cmd(args, job=job, agent_url=agent_url, rank=rank))


def main() -> None:
    try:
        app()
    except PitstopError as e:  # anything a command did not turn into a message itself
        err.print(f"[bold red]error:[/] {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()

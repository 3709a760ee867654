"""What every `pitstop` command shares: the app, its exit codes, how errors are said, settings and the
coordinator's client."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console

from pitstop import logs
from pitstop.errors import InvalidRequest, PitstopError

EXIT_FAILED, EXIT_USAGE, EXIT_STILL_RUNNING = 1, 2, 3
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
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


def fail(e: PitstopError, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps({"error": e.to_dict()}))
    else:
        # Not wrapped by rich: paths and ids in a message must survive copying and grep
        err.print(f"[bold red]error:[/] {e.message}", soft_wrap=True)
        if e.action:
            err.print(f"[bold]what to do:[/] {e.action}", soft_wrap=True)
    raise typer.Exit(1)


def settings_of(cls, **kw):  # noqa: ANN001, ANN202 - a pydantic-settings class
    """Build settings; a bad value is an operator's error, said plainly, not a traceback."""
    from pydantic import ValidationError

    try:
        return cls(**kw)
    except ValidationError as e:
        prefix = cls.model_config.get("env_prefix", "")
        bad = "; ".join(f"{prefix}{'_'.join(map(str, x['loc'])).upper()}={x.get('input')!r}: {x['msg']}"
                        for x in e.errors())
        fail(InvalidRequest(f"bad setting: {bad}",
                             action="fix the flag or the variable (environment, /etc/pitstop/*.env) and start again"))



def setup_logs(as_json: bool) -> None:
    """A service's logging (PITSTOP_LOG_LEVEL sets the level); a bad level is said, not raised."""
    try:
        logs.setup(json=as_json)
    except PitstopError as e:
        fail(e)


def given(**flags: Any) -> dict[str, Any]:
    """The flags an operator actually gave: only these override the environment (PITSTOP_*),
    which overrides the defaults.  A flag given its default value by the command line itself
    would silently beat the environment (PITSTOP_AGENT_SPARE=true once left a host active)."""
    return {k: v for k, v in flags.items() if v is not None}



def coordinator_option() -> Any:
    return typer.Option(None, "--coordinator", envvar="PITSTOP_COORDINATOR", show_envvar=True,
                        help="the coordinator's URL, http(s)://HOST:PORT; several, comma-separated, where "
                             "coordinators stand by for one another (the one that leads is found)")


def agent_option() -> Any:
    """This host's agent, for the commands that run beside it (`pitstop run`, `pitstop hold`)."""
    return typer.Option(os.environ.get("PITSTOP_AGENT", "http://127.0.0.1:7070"), "--agent",
                        help="this host's agent (http://HOST:PORT or unix:/path)")


def client(url: str | None, as_json: bool = False):  # noqa: ANN202
    """The coordinator's client; a missing or malformed URL is said plainly, not raised."""
    from pitstop.wire.coordinator_client import CoordinatorClient

    try:
        return CoordinatorClient(url)
    except PitstopError as e:
        fail(e, as_json)


def ask(coordinator: str | None, as_json: bool, call: Callable[[Any], Any]) -> Any:
    """One call to the coordinator: its answer, or the error said plainly (exit 1).  With --json
    the answer is printed here and None returned: the caller has nothing left to show."""
    c = client(coordinator, as_json)
    try:
        data = call(c)
    except PitstopError as e:
        fail(e, as_json)
    if as_json:
        print(json.dumps(data, indent=1))
        return None
    return data


def age(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.0f}m"


def until_done(c: Any, o: dict[str, Any], wait: bool, timeout: float) -> dict[str, Any]:
    """The operation `o`, read again until it is done or `timeout` passes (only with `wait`)."""
    import time

    end = time.monotonic() + timeout
    while wait and not o["done"] and time.monotonic() < end:
        time.sleep(0.2)
        o = c.op(o["name"])
    return o

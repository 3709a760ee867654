"""The `pitstop` command: a thin layer over the library (as runc is over libcontainer).

One Typer app (common.py), its commands grouped by who runs them: the services (services.py),
operators (operators.py), the fleet as a whole (fleet.py) and the private CA (pki.py).  Importing
the modules registers their commands, in the order `pitstop --help` lists them."""

from __future__ import annotations

import sys

from pitstop.cli.common import EXIT_FAILED, EXIT_STILL_RUNNING, EXIT_USAGE, app, err
from pitstop.errors import PitstopError

# isort: off
# Importing them registers their commands, in this order in `pitstop --help`.
from pitstop.cli import services  # noqa: F401, E402
from pitstop.cli import operators  # noqa: F401, E402
from pitstop.cli import recovery  # noqa: F401, E402
from pitstop.cli import fleet  # noqa: F401, E402
from pitstop.cli import pki  # noqa: F401, E402
# isort: on

__all__ = ["EXIT_FAILED", "EXIT_STILL_RUNNING", "EXIT_USAGE", "app", "main"]


def main() -> None:
    try:
        app()
    except PitstopError as e:  # anything a command did not turn into a message itself
        err.print(f"[bold red]error:[/] {e}")
        sys.exit(1)

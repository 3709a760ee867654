"""`pitstop pki`: a private CA for mutual TLS between pitstop's services."""

from __future__ import annotations

from pathlib import Path

import typer

from pitstop.cli.common import (
    app,
    fail,
)
from pitstop.errors import InvalidRequest, PitstopError

pki = typer.Typer(no_args_is_help=True, help="A private CA for mutual TLS between pitstop's services.")
app.add_typer(pki, name="pki")


@pki.command("init")
def pki_init(directory: Path = typer.Argument(..., help="where the CA's ca.pem and ca.key go (keep ca.key offline)")) -> None:
    """Create the cluster's CA."""
    from pitstop import tls

    try:
        print(tls.init_ca(directory))
    except PitstopError as e:
        fail(e)
    except OSError as e:
        fail(_cannot_write(directory, e))


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
        fail(InvalidRequest(f"certificate name: {e}",
                             action="it is also the file name NAME.pem: use the host's or the person's short name"))
    try:
        crt, key = tls.issue(directory, name, san, days, role=role)
    except PitstopError as e:
        fail(e)
    except OSError as e:
        fail(_cannot_write(directory, e))
    print(f"PITSTOP_TLS_CA={directory / 'ca.pem'}\nPITSTOP_TLS_CERT={crt}\nPITSTOP_TLS_KEY={key}")

"""What a listen address, a service URL and a host name must look like.

Checked when settings load, so a typo stops the service at start with the setting's name and
what was expected (cli._settings says it), instead of a traceback from deep in the server or,
worse, a service that logs "up" while it listens nowhere (a port above 65535).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from typing import Annotated

import httpx
from pydantic import AfterValidator

from pitstop.errors import FailedPrecondition

_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62})$")
_LABEL = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def split_host_port(value: str) -> tuple[str, int]:
    """HOST:PORT or [V6]:PORT into its parts (an empty host is loopback's)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{value!r} is not HOST:PORT (e.g. 0.0.0.0:7070 or [::]:7070)")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"{value!r}: an IPv6 host goes in brackets, [::1]:7070")
        host = host[1:-1]
        ipaddress.IPv6Address(host)  # ValueError names what is wrong
    elif ":" in host:
        raise ValueError(f"{value!r}: an IPv6 host goes in brackets, [::1]:7070")
    elif host and not all(_LABEL.match(p) for p in host.split(".")):
        raise ValueError(f"{value!r}: {host!r} is neither an address nor a host name")
    return host or "127.0.0.1", int(port)


def _listen(value: str, *, any_port: bool) -> str:
    _, port = split_host_port(value)
    low = 0 if any_port else 1
    if not low <= port <= 65535:
        raise ValueError(f"{value!r}: port {port} is outside {low}-65535")
    return value


def check_url(value: str) -> str:
    """`value` if it is an http(s)://HOST[:PORT] URL; ValueError saying what is wrong otherwise."""
    try:
        u = httpx.URL(value)
    except httpx.InvalidURL as e:
        raise ValueError(f"{value!r} is not a URL ({e})") from None
    if u.scheme not in ("http", "https") or not u.host:
        raise ValueError(f"{value!r} is not http(s)://HOST:PORT")
    if u.port is not None and not 1 <= u.port <= 65535:
        raise ValueError(f"{value!r}: port {u.port} is outside 1-65535")
    return value


def check_host_name(value: str) -> str:
    """`value` if it may name a host (and a file): ValueError saying what is wrong otherwise."""
    if not _HOST_NAME.match(value):
        raise ValueError(f"{value!r} is not a host name: 1-63 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return value


ListenAddress = Annotated[str, AfterValidator(lambda v: _listen(v, any_port=False))]
DataListenAddress = Annotated[str, AfterValidator(lambda v: _listen(v, any_port=True))]  # 0: any free port
def split_urls(value: str) -> list[str]:
    """`URL1,URL2,...` as a list, each without its trailing slash (several coordinators: one leads, and
    the clients find which)."""
    return [u.strip().rstrip("/") for u in value.split(",") if u.strip()]


def check_urls(value: str) -> str:
    """`value` if it is one http(s) URL or several, comma-separated; ValueError naming the bad one."""
    urls = [u.strip() for u in value.split(",") if u.strip()]
    if not urls:
        raise ValueError("no URL given")
    for u in urls:
        check_url(u)
    return value


ServiceURL = Annotated[str, AfterValidator(check_url)]
ServiceURLs = Annotated[str, AfterValidator(check_urls)]
"""One URL or several, comma-separated: every coordinator of a cluster, one of which leads."""
HostName = Annotated[str, AfterValidator(check_host_name)]


def listening_socket(host: str, port: int, what: str, *, datagram: bool = False) -> socket.socket:
    """Bind (and listen) now, before anything else starts: a port another process holds, or an
    address this host does not have, then stops the service at once with both named, instead of
    a server framework's traceback after the service has mounted and adopted things."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        if not datagram:
            return socket.create_server((host, port), family=family, backlog=2048)
        s = socket.socket(family, socket.SOCK_DGRAM)
        try:
            s.bind((host, port))
        except BaseException:
            s.close()
            raise
        return s
    except OSError as e:
        where = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        proto = "udp" if datagram else "tcp"
        why = (e.strerror or str(e)).split(" (while attempting")[0]  # create_server repeats the address
        raise FailedPrecondition(f"cannot listen on {where} ({proto}) for {what}: {why}", code="cannot_listen",
                                 action=f"another process may hold the port (`ss -lnp{proto[0]} 'sport = :{port}'`) "
                                        "or the address is not on this host: stop it or choose another address"
                                 ) from None

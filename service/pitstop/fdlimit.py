"""How many connections a service can hold: its file-descriptor limit, raised as far as allowed,
and the share of it the HTTP server may spend on connections.

Why: a service whose limit is the kernel's default 1,024 ran out of descriptors at 1,100 idle
connections, and then failed even the requests of its own agents and operators (GET /v1/hosts);
the limit the server's concurrency is set from must be one the process actually has.  The systemd
units raise the hard limit (LimitNOFILE); the service takes the soft limit up to it at start.
"""

from __future__ import annotations

import resource

import structlog

log = structlog.get_logger("pitstop.fdlimit")

WANT = 65536
RESERVE = 256  # descriptors kept for everything but HTTP connections: the database, CRIU, pipes, images


def raise_nofile(want: int = WANT) -> int:
    """The soft RLIMIT_NOFILE taken up to `want` (never past the hard limit); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the file-descriptor limit", soft=soft, hard=hard, error=repr(e))
    return int(soft) if soft != resource.RLIM_INFINITY else want


def concurrency(want: int, what: str) -> int:
    """`want` connections at once, or what the descriptor limit leaves for them (said once)."""
    limit = raise_nofile()
    room = max(16, limit - RESERVE)
    if room < want:
        log.warning(f"{what}: fewer connections than it is built for, for lack of file descriptors",
                    connections=room, wanted=want, nofile=limit,
                    action="raise LimitNOFILE (the shipped units set 65536)")
        return room
    return want

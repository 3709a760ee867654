"""A service's stop has a deadline too.

When the event loop ends, requests may still run in worker threads: a pre-copy answers its POST
only when it ends (minutes for a large host), a restore waits for CRIU, a capture's long poll
waits up to a minute.  Python joins non-daemon threads at exit, and the request threads
(anyio's) are not daemons, so without a deadline a stop waits for the slowest of them, and
systemd kills the service at TimeoutStopSec instead (30 s in the units we ship).  What such a
thread leaves behind is what a killed service leaves behind, which the next start reconciles
(the agent's `reconcile`, the coordinator's), so leaving without it is safe and says so.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import structlog

log = structlog.get_logger("pitstop.stopping")

STOP_S = 10.0  # what a stop may take beyond the servers' own graceful shutdown


def _running() -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t is not threading.current_thread() and not t.daemon and t.is_alive()]


def leave_within(timeout_s: float, service: str) -> None:
    """Wait up to `timeout_s` for the threads still running requests, then end the process
    without them (exit status 0: the stop was asked for)."""
    end = time.monotonic() + timeout_s
    for t in _running():
        t.join(max(0.0, end - time.monotonic()))
    left = _running()
    if not left:
        return
    log.warning(f"{service} stopping with requests still running; leaving without them",
                threads=sorted({t.name for t in left}), waited_s=timeout_s)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)

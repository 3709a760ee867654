"""Restored workers in a systemd scope of their own.

A restored tree is the agent's child (it is a child subreaper), so it would sit in the
agent's cgroup, and a restart of the agent's unit could take it down.  Where systemd is
PID 1, the agent asks it (StartTransientUnit over D-Bus, through busctl) to move the
restored root into `pitstop-worker-<id>-<pid>.scope`: the worker's CPU and memory are then
accounted on its own, and stopping or restarting pitstop-agent.service never touches it
(the unit's KillMode=process is the second line of defence).  Without systemd (containers,
this CI) nothing is done.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable

import structlog

from pitstop.agent.timeouts import SCOPE_BUS_TIMEOUT_S, SCOPE_CALL_TIMEOUT_S

log = structlog.get_logger("pitstop.agent.scope")


def systemd_running() -> bool:
    return os.path.isdir("/run/systemd/system")


def scope_name(worker_id: str, pid: int) -> str:
    return f"pitstop-worker-{re.sub(r'[^A-Za-z0-9_.-]', '-', worker_id)}-{pid}.scope"


def busctl_args(worker_id: str, pid: int, more: tuple[int, ...] = ()) -> list[str]:
    return ["busctl", "call", f"--timeout={SCOPE_BUS_TIMEOUT_S}", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
            "org.freedesktop.systemd1.Manager", "StartTransientUnit", "ssa(sv)a(sa(sv))",
            scope_name(worker_id, pid), "fail", "3",
            "PIDs", "au", str(1 + len(more)), str(pid), *map(str, more),
            "Description", "s", f"pitstop worker {worker_id} (restored)",
            "CollectMode", "s", "inactive-or-failed", "0"]


def place(worker_id: str, pid: int, *, more: tuple[int, ...] = (), present: Callable[[], bool] = systemd_running,
          run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> str | None:
    """Move a restored root (and `more`: its output pumps) into its own scope; return the
    scope's name, or None (and why, logged)."""
    if not present():
        return None
    try:
        p = run(busctl_args(worker_id, pid, more), capture_output=True, text=True, timeout=SCOPE_CALL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("cannot place restored worker in a scope", worker=worker_id, error=str(e))
        return None
    if p.returncode != 0:
        log.warning("systemd refused a scope for the restored worker", worker=worker_id,
                    error=(p.stderr or p.stdout).strip()[:300])
        return None
    return scope_name(worker_id, pid)

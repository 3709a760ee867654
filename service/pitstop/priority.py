"""The CPU priority of pitstop's own services on a host whose cores the job keeps busy.

A training job keeps every core busy (its ranks, their data loaders), and a move's first
phases run while it does: the coordinator's calls, each agent's pause of its ranks, the
pre-copy.  At the same priority as the job's processes the agent gets one share among many and
answers late; with 8 ranks on 2 cores a pause round was measured at up to 1 s here
(docs/benchmarks.md).  Once the job is paused nothing competes, so a higher priority costs the
job nothing but the agent's own, short, work.  Restored workers get their own nice value back
from their images (CRIU restores it), not the agent's.
"""

from __future__ import annotations

import os

import structlog

log = structlog.get_logger()


def apply(nice: int, who: str) -> None:
    """Set this process's nice value before it starts any thread (threads inherit it; a nice
    value is per thread on Linux).  Lowering it needs root (CAP_SYS_NICE): without, say so."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if nice == current:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        log.info("cpu priority set", service=who, nice=nice)
    except PermissionError:
        log.warning("cannot raise this service's CPU priority", service=who, nice=nice, current=current,
                    action="run it as root (or with CAP_SYS_NICE), or set its NICE setting to 0")

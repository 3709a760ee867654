"""`pitstop run` as a container's command: the container is the worker.

    podman run --runtime runc -v /run/pitstop:/run/pitstop -v /opt/pitstop:/opt/pitstop:ro ... \\
        IMAGE /opt/pitstop/bin/pitstop run --job J -- python train.py

Inside a container the unit that moves is the container itself, as the runtime checkpoints and
restores it (container/podman.py): its process tree, mounts, /dev/shm, cgroup and namespaces.
So here `pitstop run` makes no PID namespace of its own (the container's is the worker's, and
a container's root usually lacks CAP_SYS_ADMIN to make one), starts CMD as its child with the
container's own stdout and stderr (the runtime's log keeps them, on whichever host the
container runs), and registers the container with the agent of its host, through the agent's
socket mounted into the container.  The agent finds the container's init from the caller's
credentials (SO_PEERCRED) and its cgroup; the launcher names only itself.

It moves with the container: it stays CMD's parent, forwards the signals the runtime sends the
container (`podman stop`: SIGTERM to its init) to CMD, reports CMD's exit to the agent of the
host it ends on, and exits with CMD's status, which becomes the container's.  No connection to
the agent stays open between calls: a checkpoint must find none (a socket to a process outside
the container cannot be restored).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pitstop.errors import PitstopError
from pitstop.launcher.timeouts import CONTAINER_AGENT_CALL_TIMEOUT_S
from pitstop.wire.agent_client import AgentClient

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)
EXITED_TRIES = 20  # the exit report, retried while the container is being moved (its agent changes)


def inside(info: dict) -> bool:
    """Whether this process runs in a container, as its agent sees it (`caller` in the agent's
    info on its local socket: the caller's cgroup and mount namespace).  Not the files a runtime
    leaves in a container's root (/.dockerenv, /run/.containerenv): a host's own root made from a
    container image carries them too."""
    return bool((info.get("caller") or {}).get("container"))


def _client(sock: str) -> AgentClient:
    """A client for one call: closed after it, so no connection outlives the call."""
    return AgentClient("http://agent", uds=sock, timeout=CONTAINER_AGENT_CALL_TIMEOUT_S)


def run(cmd: list[str], env: dict[str, str], *, job: str, rank: int, world: int | None, sock: str,
        snapshot_every_s: float | None = None) -> int:
    """Start CMD, register the container, wait; CMD's exit status (128+N for signal N)."""
    try:
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
    except OSError as e:
        print(f"pitstop run: cannot start {cmd[0]}: {e}", file=sys.stderr)
        return 127
    try:
        with _client(sock) as c:
            w = c.register(job, rank, os.getpid(), world=world, snapshot_every_s=snapshot_every_s,
                           container=True)
    except PitstopError as e:
        print(f"pitstop run: could not register the container with the agent: {e}", file=sys.stderr)
        p.kill()
        p.wait()
        return 125

    def forward(sig: int, _frame: object) -> None:
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    while True:
        try:
            code = p.wait(timeout=1.0)  # polled: a forwarded signal runs within the second
            break
        except subprocess.TimeoutExpired:
            continue
    status = 128 - code if code < 0 else code
    _report_exit(sock, w["id"], status)
    return status


def _report_exit(sock: str, wid: str, status: int) -> None:
    """Tell the agent of the host the container ends on.  Best effort: the agent also sees the
    container's processes gone (lost, status unknown)."""
    at = time.time()
    for _ in range(EXITED_TRIES):
        try:
            with _client(sock) as c:
                c.exited(wid, status, at=at)
            return
        except PitstopError as e:
            if e.code == "not_found":
                time.sleep(0.5)  # the container was restored here a moment ago: its record is coming
                continue
            print(f"pitstop run: could not report the exit to the agent: {e}", file=sys.stderr)
            return

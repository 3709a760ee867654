"""One agent per state directory: a lock held for the agent process's whole life.

Why: two agents given the same state directory (a second `pitstop agent` started by hand beside
the unit, two units with one default) each rewrite the other's agent-state.json, and the second
unlinks the first's local socket and binds its own there, so every `pitstop run` on the host then
reaches an agent that does not know its workers and fails with a misleading error.  The second
agent must refuse to start instead, naming the agent that holds the directory.

The lock is flock(2) on <state_dir>/agent.lock: the kernel drops it when the holder exits, however
it exits (a SIGKILL, an OOM kill), so a stale file never keeps an agent out.  The descriptor is
close-on-exec, and the agent starts its helpers with subprocess (never a bare fork), so no worker,
CRIU or lazy-pages daemon ever inherits it.  The file holds the holder's pid, name and URL, for the
refusal's message only: the lock, not the text, decides.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from pathlib import Path

from pitstop.errors import FailedPrecondition

LOCK_NAME = "agent.lock"


class StateDirHeld(FailedPrecondition):
    code = "state_dir_held"


_held: list[int] = []  # the descriptors this process holds (one per state directory); never closed


def _holder(fd: int) -> dict[str, object]:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        d = json.loads(text) if text.strip() else {}
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def hold(state_dir: Path, *, name: str, url: str) -> int:
    """Take `state_dir`'s lock for the rest of this process's life, or raise StateDirHeld saying
    which process holds it.  Returns the lock's descriptor (kept open; closing it drops the lock)."""
    path = Path(state_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        who = _holder(fd)
        os.close(fd)
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        pid = who.get("pid")
        named = f"pid {pid}" if pid else "another process"
        if who.get("name"):
            named += f", agent {who['name']} at {who.get('url', '?')}"
        raise StateDirHeld(
            f"the state directory {state_dir} is another agent's: {named} holds it ({path})",
            action=(f"stop that agent first ({'kill ' + str(pid) if pid else 'see fuser ' + str(path)}, or "
                    "`systemctl stop pitstop-agent` if it is the unit's), or give this agent a directory of its own "
                    "with --state-dir (PITSTOP_AGENT_STATE_DIR); two agents on one directory take each other's "
                    "state and local socket"),
            details={"state_dir": str(state_dir), "pid": pid}) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "name": name, "url": url}).encode() + b"\n", 0)
    _held.append(fd)
    return fd

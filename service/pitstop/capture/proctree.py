"""Facts about live process trees, read from /proc.

A worker is identified by its tree root's pid *and* start time, so that a
recycled pid can never be captured in its place.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    rest = raw[raw.rindex(")") + 2:].split()
    return rest  # rest[0] is state (field 3)


def exists(pid: int) -> bool:
    f = _stat_fields(pid)
    return f is not None and f[0] not in ("Z", "X")


def state(pid: int) -> str | None:
    f = _stat_fields(pid)
    return f[0] if f else None


def start_time(pid: int) -> int | None:
    """Start time in clock ticks since boot (field 22): with the pid, an identity."""
    f = _stat_fields(pid)
    return int(f[19]) if f else None


def session_id(pid: int) -> int | None:
    f = _stat_fields(pid)
    return int(f[3]) if f else None


def ns_pids(pid: int) -> list[int]:
    """The pid in each nested pid namespace, outermost first (NSpid)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return []


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                out += [int(x) for x in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
            except OSError:
                continue
    except OSError:
        pass
    return out


def tree(root: int) -> list[int]:
    """root and all its descendants, parents before children."""
    out, todo = [], [root]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children(p))
    return out


@dataclass(frozen=True)
class PipeEnd:
    """A pipe that crosses the tree boundary at one of a process's stdio fds."""

    key: str   # CRIU's external id: "pipe:[inode]"
    fd: int
    writable: bool


def stdio_pipes(pids: list[int]) -> list[PipeEnd]:
    """Distinct pipes at fds 0-2 of the tree: CRIU needs them handed back on restore."""
    seen: dict[str, PipeEnd] = {}
    for pid in pids:
        for fd in (0, 1, 2):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if not target.startswith("pipe:") or target in seen:
                continue
            flags = 0
            try:
                for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
                    if line.startswith("flags:"):
                        flags = int(line.split()[1], 8)
            except OSError:
                pass
            seen[target] = PipeEnd(target, fd, (flags & os.O_ACCMODE) != os.O_RDONLY)
    return list(seen.values())


def stop(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGSTOP)
        except ProcessLookupError:
            pass


def resume(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass


def kill_and_wait(root: int, timeout_s: float = 10.0) -> bool:
    """SIGKILL a tree root (an pid-namespace init takes its whole namespace along)."""
    st = start_time(root)
    try:
        os.kill(root, signal.SIGKILL)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not exists(root) or start_time(root) != st:
            return True
        time.sleep(0.01)
    return False

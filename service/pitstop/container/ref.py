"""Which container a process runs in, as its cgroup names it, and its pids seen from here.

Every common runtime names a container's cgroup after the container's 64-hex id: podman
`libpod-<id>` (cgroupfs and systemd managers alike), Docker `docker-<id>.scope` or `/docker/<id>`,
CRI-O `crio-<id>`, containerd's CRI `cri-containerd-<id>`.  A process's cgroup is what the
kernel says about it, whatever the process says about itself, and it is readable by the agent
for any pid: the ground truth for "this rank is in container X of engine Y".
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from pitstop.proc import proctree

PODMAN = "podman"
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (PODMAN, re.compile(r"libpod-([0-9a-f]{64})(?:\.scope)?(?:/|$)")),
    ("docker", re.compile(r"(?:docker-|/docker/)([0-9a-f]{64})(?:\.scope)?(?:/|$)")),
    ("cri-o", re.compile(r"crio-([0-9a-f]{64})(?:\.scope)?(?:/|$)")),
    ("containerd", re.compile(r"cri-containerd-([0-9a-f]{64})(?:\.scope)?(?:/|$)")),
)


@dataclass(frozen=True)
class Found:
    engine: str  # podman, docker, cri-o, containerd
    id: str      # the container's full id


def of_cgroup(text: str) -> Found | None:
    """The container a /proc/PID/cgroup text names, if any (conmon's own cgroup,
    `libpod-conmon-<id>`, is not the container's, and names none)."""
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        for engine, pat in _PATTERNS:
            m = pat.search(path)
            if m:
                return Found(engine, m.group(1))
    return None


def of_pid(pid: int) -> Found | None:
    try:
        return of_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        return None


def same_mount_ns(pid: int, other: int | str = "self") -> bool:
    """Whether `pid` sees the same mounts as `other` (default: this process)."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat(f"/proc/{other}/ns/mnt").st_ino
    except OSError:
        return False


def host_pid(caller: int, pid: int) -> int | None:
    """The pid, in this process's pid namespace, of the process that `caller` (a pid seen from
    here) names `pid` in its own namespace: `pitstop run` in a container registers its worker by
    the pid it sees.  Only the caller's descendants are looked at, so a caller can name nothing
    but its own tree.  None where no descendant has that pid there."""
    level = len(proctree.ns_pids(caller))
    if level == 0:
        return None
    for p in proctree.tree(caller)[1:]:
        nsp = proctree.ns_pids(p)
        if len(nsp) >= level and nsp[level - 1] == pid:
            return p
    return None


def container_init(pid: int) -> int | None:
    """The container's init (pid 1 of the outermost pid namespace `pid` is in below this one's),
    as a pid seen from here: the container's root process."""
    own = len(proctree.ns_pids(os.getpid())) or 1
    cur = pid
    while True:
        nsp = proctree.ns_pids(cur)
        if len(nsp) <= own:
            return None
        if nsp[own] == 1:
            return cur
        parent = _parent(cur)
        if parent is None or parent <= 1:
            return None
        cur = parent


def _parent(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2:].split()[1])

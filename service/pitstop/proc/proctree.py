"""Facts about live process trees, read from /proc.

A worker is identified by its tree root's pid *and* start time, so that a
recycled pid can never be captured in its place.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def _stat_fields(pid: int, path: str | None = None) -> list[str] | None:
    try:
        raw = Path(path or f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm may hold spaces and parentheses: split after the last ')'.
    rest = raw[raw.rindex(")") + 2:].split()
    return rest  # rest[0] is state (field 3)


def exists(pid: int) -> bool:
    """Whether any thread of `pid` still runs.

    Not only its main thread: killed, a process's main thread shows as a zombie as soon as it
    has exited, while its other threads may still be closing the files they share.  Until the
    last one has, its TCP sockets hold their addresses, and a restore of the same connections
    fails ("Can't connect inet socket back: Cannot assign requested address"; 11 kills in 30
    of a process with 16 busy threads were still holding their ports when the main thread
    alone was watched, 2026-11-30)."""
    f = _stat_fields(pid)
    if f is None:
        return False
    if f[0] not in ("Z", "X"):
        return True
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tids:
        if tid != str(pid):
            t = _stat_fields(pid, f"/proc/{pid}/task/{tid}/stat")
            if t is not None and t[0] not in ("Z", "X"):
                return True
    return False


def state(pid: int) -> str | None:
    f = _stat_fields(pid)
    return f[0] if f else None


def rss_bytes(pid: int) -> int:
    """The process's resident memory (0 when it is gone): what a whole CRIU dump of it writes, about."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def start_time(pid: int) -> int | None:
    """Start time in clock ticks since boot (field 22): with the pid, an identity."""
    f = _stat_fields(pid)
    return int(f[19]) if f else None


def is_running(pid: int, started: int | None) -> bool:
    """Whether `pid` is still the process that started at `started` (not a recycled pid)."""
    return exists(pid) and start_time(pid) == started


def kill_if_same(pid: int, started: int | None) -> None:
    """SIGKILL `pid` only while it is the process that started at `started`: a process recorded
    earlier (by another run of the agent) whose pid may since belong to someone else."""
    if started is not None and is_running(pid, started):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


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
    """Distinct pipes at fds 0-2 of the tree that lead outside it: CRIU needs them handed back on
    restore.  A pipe whose both ends the tree holds (a parent reading its child's output) is the
    tree's own: CRIU restores it as it is, and handing it back as an outside pipe would join the
    child's output to the job's and leave the parent reading nothing (seen with a training loop
    that reads its children's results, tests/gpu's check (f))."""
    seen: dict[str, PipeEnd] = {}
    for pid in pids:
        for fd in (0, 1, 2):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if not target.startswith("pipe:") or target in seen:
                continue
            seen[target] = PipeEnd(target, fd, _writable(pid, fd))
    if not seen:
        return []
    inside = _pipe_ends(pids, set(seen))
    return [p for key, p in seen.items() if inside.get(key) != {"r", "w"}]


def fd_links(pid: int) -> Iterator[tuple[str, str]]:
    """(fd, what it points to) for each open fd of pid; fds closed meanwhile, or a process gone,
    are skipped."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return
    for fd in fds:
        try:
            yield fd, os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue


def fd_flags(pid: int | str, fd: int | str) -> int | None:
    """The open flags of one fd (its fdinfo), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return None


def _writable(pid: int, fd: int) -> bool:
    flags = fd_flags(pid, fd)
    return flags is not None and (flags & os.O_ACCMODE) != os.O_RDONLY


def _pipe_ends(pids: list[int], keys: set[str]) -> dict[str, set[str]]:
    """Which ends ("r", "w") of the given pipes the tree's processes hold, at any fd."""
    ends: dict[str, set[str]] = {}
    for pid in pids:
        for fd, target in fd_links(pid):
            if target not in keys:
                continue
            flags = fd_flags(pid, fd)
            if flags is None:
                continue
            mode = flags & os.O_ACCMODE
            ends.setdefault(target, set()).update(
                {"r", "w"} if mode == os.O_RDWR else {"w"} if mode == os.O_WRONLY else {"r"})
    return ends


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
    return wait_gone(root, st, timeout_s)


def wait_gone(pid: int, started: int | None, timeout_s: float) -> bool:
    """Whether the process that started at `started` is gone within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while is_running(pid, started):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def kill_tree(root: int, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL root and every descendant, then wait until none runs; the pids killed.

    Killing the root alone would leave its children (DataLoader workers) running a while on
    their own; where that is wrong (memory about to read as zeros), every one goes at once."""
    pids = tree(root) if exists(root) else []
    kill_all(pids, timeout_s)
    return pids


def kill_all(pids: list[int], timeout_s: float = 10.0) -> bool:
    """SIGKILL every one of `pids` at once, then wait until none runs; whether none does."""
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while any(exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.002)
    return not any(exists(p) for p in pids)


TCP_REPAIR = 19          # linux/tcp.h
_SYS_PIDFD_GETFD = 438   # the same number on x86-64 and arm64
_libc = ctypes.CDLL(None, use_errno=True)


def _tcp_sockets(pids: list[int]) -> Iterator[socket.socket]:
    """Each TCP socket descriptor these processes hold, as a duplicate (pidfd_getfd) the caller
    may change (it is the same socket) and need not close; the process keeps its own."""
    for p in pids:
        try:
            pidfd = os.pidfd_open(p)
            fds = os.listdir(f"/proc/{p}/fd")
        except OSError:
            continue
        try:
            for fd in fds:
                try:
                    link = os.readlink(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if not link.startswith("socket:"):
                    continue
                dup = _libc.syscall(_SYS_PIDFD_GETFD, pidfd, int(fd), 0)
                if dup < 0:
                    continue
                try:
                    s = socket.socket(fileno=dup)
                except OSError:
                    os.close(dup)
                    continue
                try:
                    if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM:
                        yield s
                finally:
                    s.close()
        finally:
            os.close(pidfd)


def silence_tcp(pids: list[int]) -> int:
    """Put every TCP socket these processes hold into repair mode; how many.

    A socket in repair mode closes without a FIN or RST (the kernel just drops it), which is
    how CRIU lets go of a dumped tree.  The processes should be stopped first, or they could
    still send in between."""
    n = 0
    for s in _tcp_sockets(pids):
        try:
            s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
            n += 1
        except OSError:
            pass
    return n


_TCP_LISTEN = 10  # include/net/tcp_states.h


class _SockaddrUnspec(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


def _holds_named_state(pids: list[int]) -> str | None:
    """What a tree holds, besides TCP sockets, that a restore of it elsewhere on this kernel would
    collide with until the tree has exited: a unix socket bound to an abstract name, or a file
    lock; None if nothing.  A unix socket bound to a path is not: CRIU's restore binds the path
    again while the source still holds its socket (Python's multiprocessing, so every DataLoader
    worker, listens on one under /tmp/pymp-*: waiting for the source's exit for it cost 0.05-0.29 s
    of the downtime)."""
    inodes: set[str] = set()
    for p in pids:
        try:
            for fd in os.listdir(f"/proc/{p}/fd"):
                try:
                    link = os.readlink(f"/proc/{p}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    for p in pids[:1]:
        try:
            for line in Path(f"/proc/{p}/net/unix").read_text().splitlines()[1:]:
                f = line.split()
                if len(f) >= 8 and f[6] in inodes and f[7].startswith("@"):
                    return f"a unix socket bound to an abstract name ({f[7]})"
        except OSError:
            pass
    try:
        holders = {int(f[4]) for f in (ln.split() for ln in Path("/proc/locks").read_text().splitlines())
                   if len(f) > 4 and f[4].lstrip("-").isdigit()}
    except OSError:
        holders = set()
    if holders & set(pids):
        return "a file lock"
    return None


def let_go(root: int) -> str | None:
    """Free every address and port a stopped tree holds, then SIGKILL it without waiting for
    its exit; None on success, else why only its exit will do (the caller then kills it and waits).

    A killed process closes its sockets only after its memory is gone (do_exit frees the mm
    first): 0.1-0.2 s for a 770 MB rank on the test VM, seconds for a GPU host's ranks.
    A restore of the same connections on this kernel must wait for that ("Cannot assign
    requested address"); a restore elsewhere does not need to, but the coordinator cannot
    tell.  Disconnecting each TCP socket in repair mode (connect(AF_UNSPEC): the kernel sets
    it to CLOSE and unhashes it, no FIN or RST) frees its four-tuple and, with SO_REUSEADDR,
    its port at once, so the restore can start while the memory is still being freed."""
    pids = tree(root) if exists(root) else []
    if not pids:
        return None
    why = _holds_named_state(pids)
    if why:
        return why
    unspec = _SockaddrUnspec(socket.AF_UNSPEC)
    for s in _tcp_sockets(pids):
        try:
            if s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != _TCP_LISTEN:
                s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if _libc.connect(s.fileno(), ctypes.byref(unspec), ctypes.sizeof(unspec)) != 0:
                err = ctypes.get_errno()
                return f"a TCP socket could not be disconnected ({os.strerror(err)})"
        except OSError as e:
            return f"a TCP socket could not be disconnected ({e.strerror})"
    set_policy(pids, os.SCHED_IDLE)  # its exit takes only the CPU the destination's restore leaves
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return None


def set_policy(pids: list[int], policy: int) -> None:
    """Every thread of these processes to `policy` (priority 0: SCHED_OTHER, SCHED_BATCH or
    SCHED_IDLE); threads gone meanwhile are skipped."""
    for p in pids:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                os.sched_setscheduler(int(t), policy, os.sched_param(0))
            except OSError:
                pass


def discard_copy(root: int, timeout_s: float = 10.0) -> list[int]:
    """Kill a restored copy whose move did not commit, without a word on its connections.

    It holds the same TCP connections as the source it was copied from, which the rollback
    restores.  Killed plainly, its kernel would close them (FIN, retransmitted after the
    process is gone) and the job's other ranks would see their peer hang up.  Stopped, its
    sockets put in repair mode, then killed, it leaves them as they were."""
    pids = tree(root) if exists(root) else []
    stop(pids)
    silence_tcp(pids)
    return kill_tree(root, timeout_s)


_UFFD_MISSING = re.compile(rb"^VmFlags:.*\bum\b", re.M)


def filling(pids: list[int]) -> list[int]:
    """The pids with memory still registered with a userfaultfd ("um" in smaps' VmFlags).

    After a post-copy restore a lazy-pages daemon owns that memory until the fill ends; the
    kernel clears the flag when the daemon lets go.  A dump taken before that would find the
    unfilled pages absent and save them as nothing: the copy would read zeros.  The flag is
    the kernel's own record, so it holds across an agent restart."""
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/smaps", "rb") as f:
                if _UFFD_MISSING.search(f.read()):
                    out.append(p)
        except OSError:
            continue
    return out


SKIPPED_VMAS = ("[vvar]", "[vvar_vclock]", "[vsyscall]", "[vdso]")  # the kernel's, not the process's


def named_vmas(pid: int, names: tuple[str, ...]) -> list[tuple[int, int]]:
    """The mappings (start, end) of a process with one of these names (e.g. "[vdso]")."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) > 5 and parts[5].strip() in names:
                out.append(tuple(int(x, 16) for x in parts[0].split("-")))
    return out  # type: ignore[return-value]


def private_vmas(pid: int) -> list[tuple[int, int]]:
    """The readable private mappings (start, end) of a process: what a pre-copy reads and what
    its write tracking registers, so the two agree by construction."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            name = parts[5].strip() if len(parts) > 5 else ""
            if parts[1][0] != "r" or parts[1][3] != "p" or name in SKIPPED_VMAS:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end))
    return out

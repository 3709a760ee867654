"""Whether `pitstop run`'s stdout and stderr are one stream, so that the worker gets one pipe for both.

Why: the launcher relays the worker's output through pipes it drains (run.py).  With a pipe for
stdout and another for stderr, two threads copy them, and where both land in one file
(`pitstop run ... >log 2>&1`, a scheduler's joined output) lines the worker wrote in one order
arrive in another: a burst of stdout is copied while the stderr written between its lines waits
in the other pipe.  A plain run writes them in the program's own order.  So where fd 1 and fd 2
are one stream the worker's fds 1 and 2 are one pipe, and its order is the only order there is;
elsewhere (a terminal and a file, two files) they stay apart, as the caller asked.

One stream: the same open file description (kcmp(2) says so; `2>&1` and a terminal inherited
by both are that), or the same file opened twice for appending (`>>log 2>>log`: every write goes
to the end, in program order), or the same pipe, FIFO, socket or terminal (no offset: writes
arrive in the order made).  The same regular file opened twice without O_APPEND (`>log 2>log`)
is not: a plain run's writes overwrite each other there, there is no order to keep.

The worker's single pipe travels with it: a capture records one stdio pipe for both fds (its
inode, proc/proctree.stdio_pipes), and a restore hands one pipe back for that inode, which CRIU
gives to both fds, so a moved worker keeps writing both streams into one pipe.
"""

from __future__ import annotations

import ctypes
import os
import platform
import stat

KCMP_FILE = 0
_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())


def _kcmp_same(a: int, b: int) -> bool | None:
    """Whether fds a and b of this process are one open file description; None where kcmp(2)
    is not available (no CONFIG_KCMP, or refused)."""
    if _SYS_KCMP is None:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    pid = os.getpid()
    r = libc.syscall(_SYS_KCMP, pid, pid, KCMP_FILE, a, b)
    return None if r < 0 else r == 0


def _fdinfo(fd: int) -> dict[str, str]:
    try:
        with open(f"/proc/self/fdinfo/{fd}") as f:
            return dict(ln.split(":", 1) for ln in f.read().split("\n") if ":" in ln)
    except OSError:
        return {}


def one_stream(a: int = 1, b: int = 2) -> bool:
    """Whether writes to fds a and b land in one stream, in the order they are made."""
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:  # one of them closed: nothing to keep in order
        return False
    if (sa.st_dev, sa.st_ino) != (sb.st_dev, sb.st_ino):
        return False
    if not stat.S_ISREG(sa.st_mode):
        return True  # a pipe, FIFO, socket or terminal: one channel, no offsets
    same = _kcmp_same(a, b)
    if same:
        return True
    flags = [int(_fdinfo(fd).get("flags", "0").strip() or "0", 8) for fd in (a, b)]
    if all(f & os.O_APPEND for f in flags):
        return True
    if same is None:  # no kcmp: one description shows one offset and the same flags
        ia, ib = _fdinfo(a), _fdinfo(b)
        return bool(ia) and ia.get("pos") == ib.get("pos") and ia.get("flags") == ib.get("flags")
    return False

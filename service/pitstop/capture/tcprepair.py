"""Take a stopped tree's TCP sockets out of repair mode, from outside it.

CRIU puts every dumped TCP connection into TCP_REPAIR mode and, when the dump
leaves the tree stopped (pitstop's default, for rollback), leaves it there:
only a restore turns repair off.  A source that is resumed in place would
then get EPERM on its next read.  pidfd_getfd(2) (Linux >= 5.6) lets the agent
borrow each socket and clear TCP_REPAIR itself, so a rollback really is "the
same process carries on" and costs milliseconds instead of a restore.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket

SYS_pidfd_getfd = 438  # x86_64 and aarch64 alike (asm-generic numbering)
TCP_REPAIR = 19
TCP_REPAIR_OFF_NO_WP = -1  # leave repair without sending a window probe (as CRIU does)
TCP_REPAIR_OFF = 0

_libc = ctypes.CDLL(None, use_errno=True)


def _getfd(pidfd: int, fd: int) -> int:
    r = _libc.syscall(SYS_pidfd_getfd, pidfd, fd, 0)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def unrepair(pids: list[int]) -> int:
    """Clear TCP_REPAIR on every TCP socket of `pids`; return how many were cleared."""
    n = 0
    for pid in pids:
        try:
            fds = [int(f) for f in os.listdir(f"/proc/{pid}/fd")]
            pidfd = os.pidfd_open(pid)
        except (FileNotFoundError, ProcessLookupError):
            continue
        try:
            for fd in fds:
                try:
                    if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                        continue
                except OSError:
                    continue
                try:
                    mine = _getfd(pidfd, fd)
                except OSError as e:
                    if e.errno in (errno.ENOSYS, errno.EPERM):
                        raise  # cannot borrow sockets here: the caller restores from images instead
                    continue
                s = socket.socket(fileno=mine)
                try:
                    if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                        # EPERM: a listening socket, never put in repair mode; nothing to do.
                        for mode in (TCP_REPAIR_OFF_NO_WP, TCP_REPAIR_OFF):
                            try:
                                s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, mode)
                                n += 1
                                break
                            except OSError:
                                continue
                finally:
                    s.close()  # closes our duplicate only
        finally:
            os.close(pidfd)
    return n

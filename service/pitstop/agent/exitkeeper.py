"""A restored worker's exit status, kept for an agent that restarts.

The agent is a child subreaper, so the workers it restores are its children and it waits for
them.  An agent that restarted is nobody's parent: its restored workers went on running (their
own scope, KillMode=process), and only a parent can wait().  Linux 6.15 lets the holder of a
pidfd read the exit status of the process it refers to even when someone else reaped it
(ioctl PIDFD_GET_INFO asking for PIDFD_INFO_EXIT).  So at restore the agent opens a pidfd of the
worker and leaves it with a *keeper*: a `sleep` of its own in the worker's scope that does
nothing but hold that descriptor, across any number of agent restarts, also while no agent
runs at all.  A restarted agent copies the descriptor out of the keeper (pidfd_getfd), reads
the status once the worker has been reaped, and stops the keeper.

Why a process and not systemd's file-descriptor store: it works the same with and without
systemd (the dev cluster, the tests, a host that runs the agent by hand), and nothing needs
the unit's cooperation.  The keeper ends by itself after EXIT_KEEPER_LIFETIME_S, so one whose agent never came
back does not stay forever.  On a kernel without PIDFD_INFO_EXIT no keeper is started and an
adopted worker's status stays unknown, as the agent says.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import os
import select
import shutil
import struct
import subprocess
import time
from dataclasses import dataclass

from pitstop.agent.timeouts import EXIT_KEEPER_LIFETIME_S
from pitstop.proc import proctree

KEEPER_NAME = "pitstop-exit-keeper"  # its argv[0]: `ps` says what it is, and for which worker

_SYS_PIDFD_GETFD = 438  # x86_64 and aarch64 (asm-generic) alike
_PIDFD_INFO_EXIT = 1 << 3
_INFO_SIZE = 64  # PIDFD_INFO_SIZE_VER0: mask, cgroupid, 11 ids, exit_code, coredump mask, spare
_EXIT_CODE_AT = 60
_PIDFD_GET_INFO = (3 << 30) | (_INFO_SIZE << 16) | (0xFF << 8) | 11  # _IOWR(PIDFS_IOCTL_MAGIC, 11, ...)
_libc = ctypes.CDLL(None, use_errno=True)


@dataclass
class Keeper:
    pid: int
    start_time: int
    fd: int  # the worker's pidfd, by its number in the keeper

    def to_dict(self) -> dict[str, int]:
        return {"pid": self.pid, "start_time": self.start_time, "fd": self.fd}

    @classmethod
    def from_dict(cls, d: dict[str, int] | None) -> "Keeper | None":
        return cls(int(d["pid"]), int(d["start_time"]), int(d["fd"])) if d else None


def _exit_info(pidfd: int) -> int | None:
    """The wait status of the process behind `pidfd` once it has been reaped, else None."""
    buf = bytearray(struct.pack("Q", _PIDFD_INFO_EXIT) + bytes(_INFO_SIZE - 8))
    fcntl.ioctl(pidfd, _PIDFD_GET_INFO, buf)
    if not struct.unpack_from("Q", buf, 0)[0] & _PIDFD_INFO_EXIT:
        return None
    return struct.unpack_from("i", buf, _EXIT_CODE_AT)[0]


@functools.cache
def supported() -> bool:
    """Whether this kernel reports a reaped process's exit status through a pidfd (6.15+)."""
    sleep = shutil.which("sleep")
    if not hasattr(os, "pidfd_open") or not sleep:
        return False
    try:
        p = subprocess.Popen([sleep, "0"])
        fd = os.pidfd_open(p.pid)
    except OSError:
        return False
    try:
        p.wait()
        return _exit_info(fd) == 0
    except OSError:  # ENOTTY/EINVAL: no PIDFD_GET_INFO, or no PIDFD_INFO_EXIT
        return False
    finally:
        os.close(fd)


_children: dict[int, subprocess.Popen] = {}  # keepers this agent started: it reaps them


def start(worker_id: str, pid: int, start_time: int, owner: str = "") -> Keeper | None:
    """Open a pidfd of the worker and hand it to a keeper; None where the kernel cannot tell a
    non-parent the status, or the worker is already gone.  `owner` (the agent's state directory)
    goes into the keeper's name, for `ps` and for finding leftovers."""
    if not supported():
        return None
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        if proctree.start_time(pid) != start_time:  # the pid was reused: not our worker
            return None
        p = subprocess.Popen([f"{KEEPER_NAME} {worker_id} {owner}".rstrip(), str(EXIT_KEEPER_LIFETIME_S)],
                             executable=shutil.which("sleep"), pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return None
    finally:
        os.close(fd)
    _children[p.pid] = p
    return Keeper(p.pid, proctree.start_time(p.pid) or 0, fd)



def exit_status(k: Keeper, wait_s: float = 5.0) -> int | None:
    """The worker's exit status (as os.waitstatus_to_exitcode gives it) once it has ended, read
    through its keeper; None if that cannot be known (keeper gone, old kernel, not reaped within
    `wait_s`: whoever is its parent now has not collected it)."""
    if not proctree.is_running(k.pid, k.start_time):
        return None
    try:
        kfd = os.pidfd_open(k.pid)
    except OSError:
        return None
    try:
        fd = _libc.syscall(_SYS_PIDFD_GETFD, kfd, k.fd, 0)
        if fd < 0 or not proctree.is_running(k.pid, k.start_time):  # a keeper that ended meanwhile: its pid may be another's
            if fd >= 0:
                os.close(fd)
            return None
    finally:
        os.close(kfd)
    try:
        select.select([fd], [], [], wait_s)  # readable once the worker has exited
        deadline = time.monotonic() + wait_s
        while True:  # the status is there once its (new) parent has reaped it
            status = _exit_info(fd)
            if status is not None:
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
    except OSError as e:
        if e.errno not in (errno.ENOTTY, errno.EINVAL, errno.ESRCH):
            raise
        return None
    finally:
        os.close(fd)


def stop(k: Keeper | None) -> None:
    """The status is recorded (or the worker was never ours to report): the keeper goes."""
    if k is None:
        return
    p = _children.pop(k.pid, None)
    if p is not None:
        p.kill()
        p.wait()
    else:  # an earlier agent's: init or the subreaper above reaps it
        proctree.kill_if_same(k.pid, k.start_time)

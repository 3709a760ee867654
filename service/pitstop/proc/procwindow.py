"""Let concurrent dumps of ranks that share a working directory overlap.

A worker runs in a PID namespace of its own but sees the host's /proc, so when CRIU dumps it,
the parasite inside the worker's root task mounts a private /proc at a fixed name,
"proc.crtools", relative to the task's working directory, and removes it at once
(criu/pie/parasite.c, get_proc_fd).  Two dumps of ranks sharing a directory race on that
mkdir (EEXIST).  It happens at the start of a dump (once) and again after its memory is
dumped (once for the root task, once per other thread of it: the cgroup of each), with
nothing to say when from outside.

Workers started by `pitstop run` do not share one: their root task is pitstop's init, working
in a directory of its own (nsinit.py), so their locks differ and their dumps start at once.
What follows is for trees without it (an init not built, a tree registered by other means).

So: a dump holds its directory's lock until inotify reports that the first "proc.crtools" is
gone again, and the next dump starts then; their memory dumps overlap.  The later bursts can
still collide (first seen in the compare bench, 2026-11-29): the dump that meets EEXIST fails
cleanly (CRIU lets the tree run again) and is redone, at most ATTEMPTS times.  Only dumps that
nothing streams from while they run overlap (network post-copy, dump-then-copy): a dump being
streamed cannot be redone, so it keeps the lock to its end.
"""

from __future__ import annotations

import ctypes
import os
import select
import shutil
import struct
import threading
from pathlib import Path
from types import TracebackType

NAME = b"proc.crtools"
IN_DELETE = 0x00000200
IN_NONBLOCK = 0o4000
IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")

_libc = ctypes.CDLL(None, use_errno=True)
ATTEMPTS = 3
COLLISION = "Can't create a directory (-17)"


def collided(details: dict) -> bool:
    """Did the dump fail on another dump's /proc mount point (CRIU's own words, quoted back)?"""
    return any(COLLISION in line for line in details.get("criu_errors", []))


def clear_for_retry(images: Path, attempt: int, keep_log: bool = True) -> None:
    """Empty the image directory for the next attempt; keep the failed attempt's log beside it
    (`keep_log`), or not where it is kept elsewhere (agent/diagnostics.py)."""
    for f in images.iterdir():
        if f.name == "dump.log" and keep_log:
            f.rename(images / f"dump-attempt{attempt}.log")
        elif f.is_dir() and not f.is_symlink():  # a snapshot's parent is a link to an older part
            shutil.rmtree(f)
        elif not (keep_log and f.name.startswith("dump-attempt")):
            f.unlink()


class DumpStartWindow:
    """Hold `lock` from entry until CRIU's parasite has removed its /proc mount point in `cwd`.

    Falls back to holding it for the whole block where `cwd` cannot be watched."""

    def __init__(self, lock: threading.Lock, cwd: str) -> None:
        self.lock, self.cwd = lock, cwd
        self._fd = -1
        self._done = threading.Event()
        self._released = False
        self._guard = threading.Lock()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "DumpStartWindow":
        self.lock.acquire()
        fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd >= 0 and self.cwd:
            if _libc.inotify_add_watch(fd, os.fsencode(self.cwd), IN_DELETE) >= 0:
                self._fd = fd
                self._thread = threading.Thread(target=self._watch, name="dump-start-window", daemon=True)
                self._thread.start()
                return self
        if fd >= 0:
            os.close(fd)
        return self

    def _watch(self) -> None:
        while not self._done.is_set():
            if not select.select([self._fd], [], [], 0.05)[0]:
                continue
            try:
                data = os.read(self._fd, 4096)
            except BlockingIOError:
                continue
            pos = 0
            while pos + _EVENT.size <= len(data):
                _, mask, _, n = _EVENT.unpack_from(data, pos)
                name = data[pos + _EVENT.size:pos + _EVENT.size + n].rstrip(b"\0")
                pos += _EVENT.size + n
                if mask & IN_DELETE and name == NAME:
                    self._release()
                    return

    def _release(self) -> None:
        with self._guard:
            if not self._released:
                self._released = True
                self.lock.release()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._fd >= 0:
            os.close(self._fd)
        self._release()

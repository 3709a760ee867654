"""Which pages a running worker writes while its memory is pre-copied, asked of the kernel.

Soft-dirty, the kernel's usual answer (CRIU's iterative pre-dump), is not built into this
kernel.  Linux 6.7+ has another: write-protect the memory with a userfaultfd in async mode
(UFFD_FEATURE_WP_ASYNC) and read the protection bits back with the PAGEMAP_SCAN ioctl on
/proc/<pid>/pagemap.  A first write to a protected page is resolved by the kernel itself (no
fault event, no stall beyond a minor fault) and clears its bit; PAGEMAP_SCAN lists the pages
whose bit is gone as PAGE_IS_WRITTEN.  Pages of memory that was not registered (mapped after
the start, moved by mremap, a forked child's copy), and pages first touched after the start
(only pages that exist are protected: see _scan), carry no bit, so they read as written too:
every mistake this can make is toward sending a page again.

A userfaultfd serves the process that creates it, and only that process can create it, so the
worker's preloaded native/writetrack.c makes it when this agent asks (a queued signal naming a
socket here) and hands it over; it keeps no copy (CRIU cannot dump a process holding one).
This agent then registers the worker's private memory, protects it, and scans it at the pause,
all from outside through its own copy.  Closing that copy ends the tracking.

What this cannot see, and so is not used for: memory a device writes by DMA (GPU, RDMA), past
the page tables.  A process that maps a device file is left to the pre-copy's digests.
"""

from __future__ import annotations

import ctypes
import os
import platform
import secrets
import signal
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

from pitstop.proc import proctree

SOCKET_DIR = Path("/run/pitstop/writetrack")  # native/writetrack.c's WT_DIR: the two must agree
LIBRARY = "libpitstop_writetrack.so"
MAGIC = 0x70737477
HANDOFF_TIMEOUT_S = 2.0  # a worker's handler runs within microseconds of the signal; a busy one, later

_PAGEMAP_SCAN = 0xC0606610  # _IOWR('f', 16, struct pm_scan_arg)
_UFFDIO_REGISTER = 0xC020AA00  # _IOWR(0xAA, 0x00, struct uffdio_register)
_UFFDIO_API = 0xC018AA3F  # _IOWR(0xAA, 0x3F, struct uffdio_api)
_UFFD_API = 0xAA
_MODE_WP = 1 << 1
_FEATURES = (1 << 15) | (1 << 13)  # UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED
_PM_SCAN_WP_MATCHING = 1 << 0
PAGE_IS_PRESENT = 1 << 3  # include/uapi/linux/fs.h
PAGE_IS_WRITTEN = 1 << 1
PAGE_IS_SWAPPED = 1 << 4
_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_VEC = 4096  # regions per PAGEMAP_SCAN call
# A device may write these processes' memory by DMA, unseen by the page tables.
_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/infiniband", "/dev/dri", "/dev/kfd", "/dev/vfio", "/dev/accel")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
_libc.ioctl.restype = ctypes.c_int
_libc.sigqueue.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
_libc.sigqueue.restype = ctypes.c_int


class _Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class _ScanArg(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "size", "flags", "start", "end", "walk_end", "vec", "vec_len", "max_pages",
        "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]


class _Register(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("ioctls", ctypes.c_uint64)]


class _Api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


def signal_number() -> int:
    """SIGRTMAX-6, as native/writetrack.c computes it."""
    return int(signal.SIGRTMAX) - 6


class TrackError(OSError):
    """A step of the tracking failed: the process is digested instead."""


def _ioctl(fd: int, req: int, arg: ctypes.Structure) -> int:
    r = _libc.ioctl(fd, req, ctypes.byref(arg))
    if r < 0:
        e = ctypes.get_errno()
        raise TrackError(e, os.strerror(e))
    return int(r)


def _top(pid: int) -> int:
    """The end of the process's highest mapping below the kernel's ([vsyscall] lies above it)."""
    top = 0
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if not line.rstrip().endswith("[vsyscall]"):
                top = max(top, int(line.split("-", 1)[1].split(None, 1)[0], 16))
    return top


def _scan(pid: int, pagemap: int, wp: bool) -> list[tuple[int, int]]:
    """Written regions (start, end) of the whole address space; with `wp`, protect them again.

    Protecting asks only for pages that exist (present or swapped).  Without that filter the
    kernel protects every page of the range, and a page never touched gets a marker in its page
    table, which pagemap, PAGEMAP_SCAN and CRIU all take for a swapped page: the pre-copy read
    such memory as zeros and CRIU dumped it at the pause (278 MB dumped instead of 18 for a
    process with 256 MiB mapped, never touched).  A page first touched after the protection has
    no bit to lose and reads as written, so nothing is missed by leaving it bare."""
    vec = (_Region * _VEC)()
    out: list[tuple[int, int]] = []
    start, end = 0, _top(pid)
    while start < end:
        a = _ScanArg(size=ctypes.sizeof(_ScanArg), flags=_PM_SCAN_WP_MATCHING if wp else 0, start=start,
                     end=end, vec=ctypes.addressof(vec), vec_len=_VEC, category_mask=PAGE_IS_WRITTEN,
                     category_anyof_mask=(PAGE_IS_PRESENT | PAGE_IS_SWAPPED) if wp else 0,
                     return_mask=PAGE_IS_WRITTEN)
        n = _ioctl(pagemap, _PAGEMAP_SCAN, a)
        for r in vec[:n]:
            if out and out[-1][1] == r.start:
                out[-1] = (out[-1][0], int(r.end))
            else:
                out.append((int(r.start), int(r.end)))
        if a.walk_end <= start:
            break
        start = int(a.walk_end)
    return out


@dataclass
class Tracked:
    """One process whose writes this agent tracks: its pid here and this agent's uffd of it."""

    pid: int
    uffd: int
    pagemap: int
    registered_bytes: int = 0
    registered: set[tuple[int, int]] = field(default_factory=set)  # the VMAs (start, end) registered

    def protect(self) -> None:
        """Write-protect all of its registered memory that exists: from now on a write shows
        (start() does it)."""
        _scan(self.pid, self.pagemap, wp=True)

    def refresh(self) -> None:
        """Register the memory it mapped since it was last looked at, then protect everything: the
        start of a new interval (a snapshot's, after its dump).  Why: a mapping made after the
        registration (a new malloc arena, a large tensor's mmap) carries no protection, so all of
        it reads as written at every later look; without this a long-running rank's deltas grew
        until they were most of its memory (a snapshot's pause from 0.7 s to 3-7.7 s)."""
        _register(self)
        self.protect()

    def written(self) -> list[tuple[int, int]]:
        """Regions (start, end) written since the start, sorted; call it with the process stopped
        and before close(): once the uffd is closed the bits no longer mean anything."""
        return _scan(self.pid, self.pagemap, wp=False)

    def close(self) -> None:
        for fd in (self.uffd, self.pagemap):
            if fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        self.uffd = self.pagemap = -1

    def __del__(self) -> None:  # a basis dropped on a failure path: its tracking ends with it
        if self.uffd >= 0 or self.pagemap >= 0:
            self.close()


def unavailable() -> str | None:
    """Why this kernel cannot track writes this way (None: it can), tried on this process itself."""
    nr = _SYS_USERFAULTFD.get(platform.machine())
    if nr is None:
        return f"write tracking is not wired for {platform.machine()}"
    u = int(_libc.syscall(nr, os.O_CLOEXEC | os.O_NONBLOCK | 1))  # UFFD_USER_MODE_ONLY
    if u < 0:
        return f"userfaultfd() failed: {os.strerror(ctypes.get_errno())}"
    try:
        try:
            _ioctl(u, _UFFDIO_API, _Api(api=_UFFD_API, features=_FEATURES))
        except TrackError as e:
            return f"the kernel lacks async userfaultfd write-protection (Linux 6.7+): {e.strerror}"
    finally:
        os.close(u)
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        a = _ScanArg(size=ctypes.sizeof(_ScanArg), start=0, end=4096, category_mask=PAGE_IS_WRITTEN,
                     return_mask=PAGE_IS_WRITTEN)
        try:
            _ioctl(fd, _PAGEMAP_SCAN, a)
        except TrackError as e:
            return f"the kernel lacks the PAGEMAP_SCAN ioctl (Linux 6.7+): {e.strerror}"
    finally:
        os.close(fd)
    return None


def ineligible(pid: int) -> str | None:
    """Why this process cannot be tracked (None: it can be asked)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError as e:
        return f"cannot read it: {e.strerror}"
    if LIBRARY not in maps:
        return f"{LIBRARY} is not loaded in it (not started by `pitstop run`)"
    dev = next((ln.split()[-1] for ln in maps.splitlines() if ln.split()[-1].startswith(_DEVICE_PREFIXES)), None)
    if dev:
        return f"it maps {dev}: a device may write its memory past the page tables"
    caught = next((int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith("SigCgt:")), 0)
    if not caught >> (signal_number() - 1) & 1:
        return "its signal handler for the tracking is not installed (the program has its own)"
    return None


def _register(t: Tracked) -> None:
    """Register each private VMA the pre-copy reads that is not registered yet; one that will not
    register (a mapping the kernel refuses, or one gone since) stays unregistered, so all its pages
    read as written.  (Registering a VMA again with the same uffd is a no-op for the kernel: one
    that split or merged since is simply asked again.)"""
    for start, end in proctree.private_vmas(t.pid):
        if (start, end) in t.registered:
            continue
        try:
            _ioctl(t.uffd, _UFFDIO_REGISTER, _Register(start=start, len=end - start, mode=_MODE_WP))
            t.registered.add((start, end))
            t.registered_bytes += end - start
        except TrackError:
            continue


def start(pids: list[int], timeout_s: float = HANDOFF_TIMEOUT_S) -> tuple[dict[int, Tracked], dict[int, str]]:
    """Start tracking writes of `pids` (pids here): those tracked from now on, and why not for the rest.

    Call it before the first page is read: a page counts as unchanged only if it was not written
    after its protection, and it was read after."""
    tracked: dict[int, Tracked] = {}
    why: dict[int, str] = {}
    asked: set[int] = set()
    for pid in pids:
        r = ineligible(pid)
        if r:
            why[pid] = r
        else:
            asked.add(pid)
    if not asked:
        return tracked, why
    nonce = secrets.randbits(64)
    path = SOCKET_DIR / f"{nonce:016x}.sock"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    made_parent = not SOCKET_DIR.parent.exists()  # /run/pitstop: systemd's RuntimeDirectory, or ours
    try:
        for attempt in (1, 2):  # another request may remove the directory, empty, between the two
            SOCKET_DIR.mkdir(mode=0o711, parents=True, exist_ok=True)
            os.chmod(SOCKET_DIR, 0o711)  # the agent's umask (systemd: 0077) would keep other users' workers out
            if made_parent:
                os.chmod(SOCKET_DIR.parent, 0o755)
            try:
                srv.bind(str(path))
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        os.chmod(path, 0o666)  # a worker may run as any user; only root can bind here
        srv.listen(len(asked) + 8)
    except OSError as e:
        srv.close()
        return tracked, {**why, **{p: f"cannot listen at {path}: {e.strerror}" for p in asked}}
    try:
        for pid in sorted(asked):
            if _libc.sigqueue(pid, signal_number(), ctypes.c_void_p(nonce)) != 0:
                why[pid] = f"sigqueue: {os.strerror(ctypes.get_errno())}"
                asked.discard(pid)
        deadline = time.monotonic() + timeout_s
        while asked and time.monotonic() < deadline:
            srv.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                break
            with conn:
                t = _receive(conn, asked, deadline, why)
                if t is not None:
                    asked.discard(t.pid)
                    tracked[t.pid] = t
        for pid in asked:
            why[pid] = f"it did not answer within {timeout_s:.1f} s"
    finally:
        srv.close()
        path.unlink(missing_ok=True)
        _remove_dirs()
    return tracked, why


def _remove_dirs() -> None:
    """The last request out removes the socket directory, and /run/pitstop too unless systemd
    manages it (the unit's RuntimeDirectory).  Whoever made /run/pitstop may not be the last
    out: two pre-copies at once, the first to start ending first, left it behind (make demo)."""
    try:
        SOCKET_DIR.rmdir()
    except OSError:
        return  # another request's socket is in it: the last one removes it
    if str(SOCKET_DIR.parent) in os.environ.get("RUNTIME_DIRECTORY", "").split(":"):
        return
    try:
        SOCKET_DIR.parent.rmdir()
    except OSError:
        pass  # something else lives there


def _receive(conn: socket.socket, asked: set[int], deadline: float, why: dict[int, str]) -> Tracked | None:
    pid, _, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    conn.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        msg, fds, _, _ = socket.recv_fds(conn, 8, 1)
    except OSError:
        return None
    if pid not in asked or len(msg) != 8 or struct.unpack("2I", msg)[0] != MAGIC:
        for fd in fds:  # not one of ours: nothing of it is kept
            os.close(fd)
        return None
    status = struct.unpack("2I", msg)[1]
    if status or not fds:
        asked.discard(pid)
        why[pid] = f"its userfaultfd could not be made: {os.strerror(status) if status else 'none sent'}"
        return None
    t = Tracked(pid=pid, uffd=fds[0], pagemap=-1)
    try:
        t.pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        _register(t)
        t.protect()
    except OSError as e:
        t.close()
        asked.discard(pid)
        why[pid] = f"its memory could not be protected: {e.strerror}"
        return None
    return t

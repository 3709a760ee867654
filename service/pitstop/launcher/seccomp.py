"""Keep workers off io_uring, which CRIU cannot checkpoint.

torch's TCPStore server runs on libuv, and libuv opens an io_uring instance on new
kernels (torchrun's agent creates its store that way whatever USE_LIBUV says, and
UV_USE_IO_URING=0 does not stop the ring libuv uses for epoll batching).  A process
holding a ring cannot be dumped ("Unknown ... anon_inode:[io_uring]").  So `pitstop
run` installs a one-rule seccomp filter before it starts the worker: io_uring_setup(2)
fails with ENOSYS, as on a kernel without io_uring, and libraries fall back to epoll
or threads.  The filter is inherited by every descendant and CRIU restores it.
"""

from __future__ import annotations

import ctypes
import os
import platform

PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # AUDIT_ARCH_*
NR_IO_URING_SETUP = 425  # the same on x86_64 and arm64 (the generic table)
ENOSYS = 38
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
LD_W_ABS, JEQ_K, RET_K = 0x20, 0x15, 0x06


class SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]


def deny_io_uring() -> str | None:
    """Install the filter on this process (inherited by what it starts); return why not, or None."""
    arch = ARCHES.get(platform.machine())
    if arch is None:
        return f"no seccomp rule for {platform.machine()}"
    prog = [
        SockFilter(LD_W_ABS, 0, 0, 4),                  # seccomp_data.arch
        SockFilter(JEQ_K, 0, 3, arch),                  # another ABI: allow
        SockFilter(LD_W_ABS, 0, 0, 0),                  # seccomp_data.nr
        SockFilter(JEQ_K, 0, 1, NR_IO_URING_SETUP),
        SockFilter(RET_K, 0, 0, RET_ERRNO | ENOSYS),
        SockFilter(RET_K, 0, 0, RET_ALLOW),
    ]
    arr = (SockFilter * len(prog))(*prog)
    fprog = SockFprog(len(prog), arr)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        err = ctypes.get_errno()
        if not io_uring_available(libc):  # refused already: a container runtime's profile (podman's
            return None                   # default lists no io_uring call), where a filter needs privileges
        return f"prctl(PR_SET_SECCOMP) failed: errno {err}"
    return None


def io_uring_available(libc: ctypes.CDLL | None = None) -> bool:
    """Whether this process may make an io_uring (a one-entry ring, closed at once)."""
    libc = libc or ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    fd = libc.syscall(NR_IO_URING_SETUP, 1, params)
    if fd < 0:
        return False
    os.close(fd)
    return True

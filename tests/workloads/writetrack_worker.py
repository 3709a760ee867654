"""A process whose writes the tests track (tests/test_writetrack.py): 16 MiB of its own memory,
and commands on stdin that write it in every way the kernel's tracking must see."""

import ctypes
import mmap
import os
import signal
import sys

PAGE = 4096
m = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m[:] = b"\1" * len(m)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
kept = []
libc = ctypes.CDLL(None, use_errno=True)
libc.mremap.restype = ctypes.c_void_p
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
if "--block" in sys.argv:  # the tracking's signal waits until "unblock" (a busy or masked thread)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMAX - 6])
print(hex(base), flush=True)
for line in sys.stdin:
    op, *args = line.split()
    out = "ok"
    if op == "write":  # from user space
        m[int(args[0]) * PAGE] = 9
    elif op == "kernel":  # the kernel writes it (a read() into the buffer)
        r, w = os.pipe()
        os.write(w, b"abc")
        os.readv(r, [memoryview(m)[int(args[0]) * PAGE:int(args[0]) * PAGE + 3]])
        os.close(r)
        os.close(w)
    elif op == "new":  # memory mapped after the tracking started
        e = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        e[0] = 1
        kept.append(e)
        out = hex(ctypes.addressof(ctypes.c_char.from_buffer(e)))
    elif op == "drop":  # MADV_DONTNEED, then read back (zeros now)
        n = int(args[0])
        m.madvise(mmap.MADV_DONTNEED, n * PAGE, PAGE)
        out = str(m[n * PAGE])
    elif op == "move":  # mremap 1 MiB of it elsewhere, untouched (grown to 2 MiB: its neighbour is mapped)
        src = base + int(args[0]) * PAGE
        dst = libc.mremap(ctypes.c_void_p(src), 1 << 20, 2 << 20, 1)  # MREMAP_MAYMOVE
        out = hex(dst or 0)
    elif op == "reserve":  # 256 MiB of private memory, never touched
        reserve = mmap.mmap(-1, 256 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        kept.append(reserve)
    elif op == "rtouch":  # write a page of the reserve for the first time: its address
        reserve[int(args[0]) * PAGE] = 5
        out = hex(ctypes.addressof(ctypes.c_char.from_buffer(reserve)) + int(args[0]) * PAGE)
    elif op == "huge":  # 8 MiB asked to be transparent huge pages, filled: its 2 MiB-aligned base
        huge = mmap.mmap(-1, 8 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        hbase = (ctypes.addressof(ctypes.c_char.from_buffer(huge)) + (2 << 20) - 1) & ~((2 << 20) - 1)
        off = hbase - ctypes.addressof(ctypes.c_char.from_buffer(huge))
        huge.madvise(mmap.MADV_HUGEPAGE, off, 4 << 20)
        huge[off:off + (4 << 20)] = b"\2" * (4 << 20)
        kept.append(huge)
        out = hex(hbase)
    elif op == "hwrite":  # one byte of page N of the huge pages
        huge[off + int(args[0]) * PAGE] = 7
    elif op == "unblock":
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGRTMAX - 6])
    elif op == "fds":  # it is alive and can list its descriptors (the listing's own one is gone by now)
        out = str(len(os.listdir("/proc/self/fd")))
    print(out, flush=True)

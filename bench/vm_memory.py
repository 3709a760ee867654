"""What fresh memory costs on this machine: 4 KiB against 2 MiB pages, warm against handed back.

Every phase of a move that lands bytes in memory nobody touched a moment ago (CRIU's dump into
the image tmpfs, the receiver's writes, CRIU's restore into the worker's fresh anonymous memory)
pays this machine's page-fault cost, and on a VM with free page reporting that cost depends on
whether the guest gave the memory back to the host in between.  This measures it, so that the
figures of bench/compare.py can be read against it:

- fill: memset of a fresh anonymous mapping (fault, zero, write), 4 KiB pages (MADV_NOHUGEPAGE)
  and 2 MiB pages (MADV_HUGEPAGE), each right after the same amount was freed (warm) and again
  after `--rest-s` seconds idle (what the guest reported to the host meanwhile is printed);
- copy: preadv of an image-sized file on a huge-page tmpfs into fresh anonymous memory, which is
  what CRIU's eager restore does for every page.

    .venv/bin/python bench/vm_memory.py [--mib 768] [--rest-s 5]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import host_reclaimed_kib, machine  # noqa: E402

_libc = ctypes.CDLL(None)


def _fresh(nbytes: int, huge: bool) -> mmap.mmap:
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    return m


def fill(nbytes: int, huge: bool) -> float:
    """GB/s of a memset of fresh memory."""
    m = _fresh(nbytes, huge)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    t = time.perf_counter()
    _libc.memset(ctypes.c_void_p(addr), 0x5A, ctypes.c_size_t(nbytes))
    dt = time.perf_counter() - t
    del addr
    m.close()
    return nbytes / dt / 1e9


def copy(fd: int, nbytes: int, huge: bool) -> float:
    """GB/s of preadv from a file into fresh memory, 4 MiB at a time (as a restore fills a mapping)."""
    m = _fresh(nbytes, huge)
    mv = memoryview(m)
    t = time.perf_counter()
    off = 0
    while off < nbytes:
        off += os.preadv(fd, [mv[off:off + (4 << 20)]], off)
    dt = time.perf_counter() - t
    mv.release()
    m.close()
    return nbytes / dt / 1e9


def _reported() -> str:
    r = host_reclaimed_kib()
    return "" if r is None else f"{r >> 10}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=768, help="bytes per measurement (one rank's image here)")
    ap.add_argument("--rest-s", type=float, default=5.0, help="idle time before the 'after a rest' figures")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    n = a.mib << 20
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}, {a.mib} MiB per figure, GB/s")
    print("| what | 4 KiB pages, warm | 4 KiB pages, after a rest | 2 MiB pages, warm | 2 MiB pages, after a rest "
          "| MiB handed to the host during the rests |")
    print("|---|---|---|---|---|---|")
    mnt = Path(tempfile.mkdtemp(prefix="pitstop-vmmem-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"huge=within_size,size={a.mib + 64}m,mode=0700",
                              "tmpfs", str(mnt)], capture_output=True).returncode == 0
    try:
        f = mnt / "pages.img"
        block = os.urandom(1 << 20)
        with open(f, "wb") as out:
            for _ in range(a.mib):
                out.write(block)
        fd = os.open(f, os.O_RDONLY)
        try:
            for rep in range(a.repeats):
                for what, fn in (("fill (memset)", lambda h: fill(n, h)),
                                 (f"copy from {'a huge-page' if mounted else 'a'} tmpfs (preadv)",
                                  lambda h: copy(fd, n, h))):
                    row, handed = [], 0
                    for huge in (False, True):
                        fn(huge)  # the same amount touched and freed: what follows is warm
                        warm = fn(huge)
                        r0 = host_reclaimed_kib()
                        time.sleep(a.rest_s)
                        r1 = host_reclaimed_kib()
                        rested = fn(huge)
                        handed += (r1 - r0) >> 10 if r0 is not None and r1 is not None else 0
                        row += [f"{warm:.2f}", f"{rested:.2f}"]
                    print(f"| {what} #{rep + 1} | " + " | ".join(row) + f" | {handed} |", flush=True)
        finally:
            os.close(fd)
    finally:
        if mounted:
            subprocess.run(["umount", str(mnt)], check=False)
        for p in mnt.glob("*"):
            p.unlink()
        mnt.rmdir()


if __name__ == "__main__":
    main()

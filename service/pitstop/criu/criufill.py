"""CRIU's restore fills memory with UFFDIO_COPY instead of faulting in zeroed pages (native/criufill.c).

The restore is most of a pre-copied move's pause, and most of the restore is CRIU copying each
rank's pages into fresh memory at the kernel's 4 KiB fault rate, every page zeroed before it is
overwritten.  The preloaded library takes CRIU's large page reads and puts the bytes into new
pages with userfaultfd's UFFDIO_COPY, which neither faults nor zeroes.  It applies to images
with a parent (a pre-copy and its delta: pitstop's default), which CRIU reads through libc; the
rest CRIU reads in its restorer, untouched.

Each restore's CRIU is told its own report file (in the agent's state directory, named in its
environment), so that restores running at once each learn their own figures; the file goes when
the restore ends, and those of an agent that died are removed by the next.
Used for the CRIU this was read against (TESTED); the library falls back to CRIU's own read
for anything it does not take, so the fast path may be missing, never wrong.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from pitstop import nativelib
from pitstop.criu import runtime
from pitstop.proc import proctree

LIBRARY = "libpitstop_criufill.so"
# CRIU minors whose restore (criu/mem.c, criu/pagemap.c) the library was written against and
# whose restores the tests compare bitwise.
TESTED = ((4, 2),)
DIRNAME = "criufill"


def library() -> Path | None:
    return nativelib.built("PITSTOP_CRIUFILL", LIBRARY)


def unavailable(rt: runtime.CriuRuntime) -> str:
    """Why restores here fill memory CRIU's own way, or "" where the library is used."""
    if library() is None:
        return f"native/build/{LIBRARY} is not built; run `make native`"
    if tuple(rt.version[:2]) not in TESTED:
        return (f"CRIU {rt.version_str} is not one the restore's fill was tested with "
                f"({', '.join('.'.join(map(str, v)) for v in TESTED)})")
    return ""


def _remove_stale(where: Path) -> None:
    """Files of restores whose agent died mid-way: named <agent pid>-..."""
    for p in where.glob("*-*"):
        pid = p.name.split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not proctree.exists(int(pid)):
            p.unlink(missing_ok=True)


@contextlib.contextmanager
def preloaded(rt: runtime.CriuRuntime, state_dir: Path) -> Iterator[tuple[runtime.CriuCommand, Path]]:
    """(a CRIU to restore with, the report file it appends to) for one restore; the report is
    removed after."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"native/build/{LIBRARY} is not built")
    where = state_dir / DIRNAME
    where.mkdir(parents=True, exist_ok=True)
    _remove_stale(where)
    report = where / f"{os.getpid()}-{secrets.token_hex(6)}.report"
    try:
        yield runtime.preloaded(rt, lib, env={"PITSTOP_CRIUFILL_REPORT": str(report)}), report
    finally:
        report.unlink(missing_ok=True)


def read_report(report: Path) -> tuple[int, int, int]:
    """(bytes put in place by UFFDIO_COPY, bytes the library left to CRIU's read, the most threads
    one read copied with) in one restore."""
    copied = fallback = threads = 0
    try:
        text = report.read_text()
    except FileNotFoundError:
        return 0, 0, 0
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and all(p.isdigit() for p in parts):
            copied += int(parts[1])
            fallback += int(parts[2])
            threads = max(threads, int(parts[3]))
    return copied, fallback, threads

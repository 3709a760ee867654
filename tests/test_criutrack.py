"""native/criutrack.c through criu/criutrack.py: what CRIU reads as soft-dirty, with the library
preloaded, is exactly what the pre-copy's write tracking says was written; and what the library
makes CRIU believe never reaches a CRIU without it.  (That CRIU's incremental dump built on it
restores bitwise: tests/test_precopy.py, the "criu" cases; end to end: tests/test_precopy_e2e.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.criu import criutrack, runtime
from pitstop.memory import writetrack

from .test_writetrack import Worker

pytestmark = [pytest.mark.timeout(60)]

# Run with the library preloaded: what a CRIU would read of the worker's pagemap, both ways CRIU
# reads it (PAGEMAP_SCAN asking for soft-dirty; pread of the raw entries).
PROBE = r"""
import ctypes, json, os, struct, sys
pid, base, pages = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
SOFT_DIRTY, PRESENT, SWAPPED = 1 << 7, 1 << 3, 1 << 4
class Region(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]
class Arg(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("size", "flags", "start", "end", "walk_end", "vec", "vec_len",
                "max_pages", "category_inverted", "category_mask", "category_anyof_mask", "return_mask")]
libc = ctypes.CDLL(None, use_errno=True)
libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
vec = (Region * 4096)()
a = Arg(size=ctypes.sizeof(Arg), start=base, end=base + pages * 4096, vec=ctypes.addressof(vec), vec_len=4096,
        category_anyof_mask=PRESENT | SWAPPED, return_mask=PRESENT | SWAPPED | SOFT_DIRTY)
fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
n = libc.ioctl(fd, 0xC0606610, ctypes.addressof(a))
scan = sorted({(p - base) // 4096 for r in vec[:n] if r.categories & SOFT_DIRTY for p in range(r.start, r.end, 4096)})
raw = os.pread(fd, pages * 8, base // 4096 * 8)
entries = struct.unpack(f"{pages}Q", raw)
read = [i for i, e in enumerate(entries) if e & (1 << 55)]
print(json.dumps({"scan": scan, "pread": read, "categories": sorted({r.categories for r in vec[:n]})}))
"""


def _probe(pid: int, base: int, pages: int, preload: bool = True) -> dict:
    lib = criutrack.library()
    assert lib is not None, "run `make native`"
    env = dict(os.environ, LD_PRELOAD=str(lib) if preload else "")
    p = subprocess.run([sys.executable, "-c", PROBE, str(pid), str(base), str(pages)], env=env,
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.skipif(writetrack.unavailable() is not None, reason=str(writetrack.unavailable()))
def test_soft_dirty_is_what_the_tracking_says_was_written():
    w = Worker()
    try:
        tracked, why = writetrack.start([w.p.pid])
        assert not why, why
        t = tracked[w.p.pid]
        t.protect()
        _check_translation(w, t)
    finally:
        w.close()


def _check_translation(w: Worker, t: writetrack.Tracked) -> None:
    try:
        for n in (5, 1000, 1001):
            w("write", n)
        pages = 16 << 20 >> 12
        got = _probe(w.p.pid, w.base, pages)
        assert got["scan"] == [5, 1000, 1001], got
        assert got["pread"] == [5, 1000, 1001]
        assert all(c & 0b10 == 0 for c in got["categories"])  # PAGE_IS_WRITTEN was not asked for: not shown
        assert w.pages(t.written()) == {5, 1000, 1001}  # and the tracking itself is as it was
    finally:
        t.close()
    # Untracked now: every page reads as written, the safe side
    got = _probe(w.p.pid, w.base, 16 << 20 >> 12)
    assert len(got["scan"]) == 16 << 20 >> 12 and len(got["pread"]) == 16 << 20 >> 12


def test_crius_facts_cache_is_kept_apart():
    """CRIU caches what it found about the kernel in /run/criu.kdat.  With the library it finds
    dirty tracking this kernel does not have; a CRIU without the library must never read that."""
    lib = criutrack.library()
    assert lib is not None
    name = f".pitstop-test-{os.getpid()}"
    code = (f"import os; open('/run/criu.kdat{name}', 'w').write('x'); "
            f"os.rename('/run/criu.kdat{name}', '/run/criu.kdat{name}b'); "
            f"print(os.path.exists('/run/pitstop/criu-writetracked.kdat{name}b')); "
            f"os.unlink('/run/criu.kdat{name}b')")
    here = Path("/run/pitstop")
    made = not here.exists()
    here.mkdir(parents=True, exist_ok=True)
    try:
        p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, LD_PRELOAD=str(lib)),
                           capture_output=True, text=True, timeout=30)
        assert p.returncode == 0 and p.stdout.strip() == "True", p.stderr
        assert not list(Path("/run").glob(f"criu.kdat{name}*"))
        assert not list(here.glob(f"criu-writetracked.kdat{name}*"))
    finally:
        for f in here.glob(f"criu-writetracked.kdat{name}*"):
            f.unlink()
        if made:
            here.rmdir()


def test_crius_dirty_tracking_check_passes_only_with_the_library():
    command, why = criutrack.command()
    assert command, why
    p = subprocess.run([command.binary, "check", "--feature", "mem_dirty_track"], capture_output=True, text=True,
                       timeout=60, env=command.environ())
    assert p.returncode == 0 and "is supported" in p.stdout + p.stderr
    plain = subprocess.run([runtime.locate().binary, "check", "--feature", "mem_dirty_track"],
                           capture_output=True, text=True, timeout=60)
    if plain.returncode == 0:
        pytest.skip("this kernel has soft-dirty of its own")
    assert "Dirty tracking is OFF" in plain.stdout + plain.stderr
    w = Worker(False)  # and without the library, no pagemap reads as soft-dirty
    try:
        got = _probe(w.p.pid, w.base, 16 << 20 >> 12, preload=False)
        assert got["scan"] == [] and got["pread"] == [], got
    finally:
        w.close()


def test_an_untested_criu_is_not_used(monkeypatch):
    """The library answers the questions CRIU 4.2 asks; another CRIU may ask differently, and a
    question it did not answer would read as "unchanged": such a CRIU dumps whole."""
    real = runtime.locate()
    fake = runtime.CriuRuntime(real.binary, (9, 9, 0), real.pycriu_path, real.nft, real.source)
    monkeypatch.setattr(runtime, "locate", lambda: fake)
    criutrack.command.cache_clear()
    try:
        command, why = criutrack.command()
        assert command is None and "CRIU 9.9.0 is not one the incremental dump was tested with" in why, why
    finally:
        criutrack.command.cache_clear()

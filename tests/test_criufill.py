"""native/criufill.c through criu/criufill.py: CRIU's large page reads become UFFDIO_COPY; every
read gives the bytes libc's would, the memory stays one mapping (CRIU's restorer moves it with
mremap), and whatever the library cannot copy it reads.  (CRIU's restore with it, bitwise:
tests/test_precopy.py, the tracked and "criu" cases; a whole move: tests/test_precopy_e2e.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.criu import criufill, runtime

pytestmark = [pytest.mark.timeout(60)]

MiB = 1 << 20

# Reads `path` at `off` into anonymous private memory (as CRIU's premapped area) the way CRIU's
# async reads do: one preadv with several buffers.  Prints what came back and the mapping's shape.
PROBE = r"""
import ctypes, hashlib, json, mmap, os, sys
path, off, size, parts, touch, shift = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
m = mmap.mmap(-1, size + 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
if touch >= 0:
    m[touch:touch + 1] = b"x"  # a page already present
view = memoryview(m)[shift:shift + size]
q = size // parts
bufs = [view[i * q:(i + 1) * q if i < parts - 1 else size] for i in range(parts)]
class Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
iovs = (Iov * parts)(*[Iov(ctypes.addressof(ctypes.c_char.from_buffer(b)), len(b)) for b in bufs])
libc = ctypes.CDLL(None, use_errno=True)  # libc's preadv, as CRIU calls it (os.preadv calls preadv2)
libc.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
libc.preadv.restype = ctypes.c_ssize_t
fd = os.open(path, os.O_RDONLY)
n = libc.preadv(fd, iovs, parts, off)
n = n if n >= 0 else -ctypes.get_errno()
del iovs
def mappings():
    out = []
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo < base + size + 4096 and hi > base:
            out.append(line.split()[0])
    return out
print(json.dumps({"n": n, "sha": hashlib.sha256(view).hexdigest(), "maps": mappings()}))
"""


@pytest.fixture
def lib() -> Path:
    p = criufill.library()
    assert p is not None, "run `make native`"
    return p


def _image(tmp_path: Path, name: str = "pages-1.img", size: int = 8 * MiB) -> tuple[Path, bytes]:
    data = os.urandom(size)
    p = tmp_path / name
    p.write_bytes(data)
    return p, data


def _read(lib: Path, path: Path, off: int, size: int, tmp_path: Path, *, parts: int = 4, touch: int = -1,
          shift: int = 0, preload: bool = True, threads: int = 1) -> tuple[dict, list[tuple[int, int]]]:
    report = tmp_path / "report"
    report.unlink(missing_ok=True)
    env = dict(os.environ, LD_PRELOAD=str(lib) if preload else "", PITSTOP_CRIUFILL_REPORT=str(report),
               PITSTOP_CRIUFILL_THREADS=str(threads) if threads else "")
    p = subprocess.run([sys.executable, "-c", PROBE, str(path), str(off), str(size), str(parts), str(touch),
                        str(shift)], env=env, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    lines = [tuple(int(x) for x in ln.split()[1:]) for ln in report.read_text().splitlines()] \
        if report.exists() else []
    return json.loads(p.stdout), lines


def _sha(b: bytes) -> str:
    import hashlib

    return hashlib.sha256(b).hexdigest()


@pytest.mark.parametrize("threads", [1, 3])
def test_a_page_read_is_copied_into_place_and_stays_one_mapping(lib: Path, tmp_path: Path, threads: int) -> None:
    """threads: 3 copy the 4 MiB pieces of the 22 MiB at once (as many as the CPUs, by default)."""
    img, data = _image(tmp_path, size=24 * MiB)
    got, rep = _read(lib, img, 4096, 22 * MiB, tmp_path, threads=threads)
    assert got["n"] == 22 * MiB and got["sha"] == _sha(data[4096:4096 + 22 * MiB])
    assert rep == [(22 * MiB, 0, threads)]  # all of it by UFFDIO_COPY, in 6 pieces
    assert len(got["maps"]) == 1, got["maps"]  # registered and unregistered: merged back, mremap-able


@pytest.mark.parametrize("threads", [1, 3])
def test_a_page_already_there_is_read_not_refused(lib: Path, tmp_path: Path, threads: int) -> None:
    img, data = _image(tmp_path, size=24 * MiB)
    got, rep = _read(lib, img, 0, 24 * MiB, tmp_path, parts=2, touch=17 * MiB + 123, threads=threads)
    assert got["n"] == 24 * MiB and got["sha"] == _sha(data)
    # the first buffer copied whole, the second's first piece whole (12-16 MiB), its second piece
    # (16-20 MiB) up to the present page, and the rest of that piece read; its third piece copied
    assert rep == [(24 * MiB - 3 * MiB, 3 * MiB, threads)], rep
    assert len(got["maps"]) == 1, got["maps"]


def test_threads_follow_the_idle_cpus(lib: Path, tmp_path: Path) -> None:
    """Unset, as many threads as CPUs nothing else wants (at least one): never more than the CPUs."""
    img, data = _image(tmp_path, size=24 * MiB)
    got, rep = _read(lib, img, 0, 24 * MiB, tmp_path, threads=0)  # 0: unset
    assert got["sha"] == _sha(data)
    assert len(rep) == 1 and rep[0][:2] == (24 * MiB, 0) and 1 <= rep[0][2] <= min(os.cpu_count() or 1, 6), rep


@pytest.mark.parametrize("case", ["other-file", "small", "unaligned", "past-end"])
def test_reads_it_does_not_take_are_libcs(lib: Path, tmp_path: Path, case: str) -> None:
    """Only large, page-aligned reads of a pages-<n>.img that holds them are taken; anything else
    is libc's read, with libc's result (a short read at the end of the file included)."""
    name = "core-1.img" if case == "other-file" else "pages-1.img"
    img, data = _image(tmp_path, name)
    size = {"small": 128 << 10, "past-end": 12 * MiB}.get(case, 4 * MiB)
    got, rep = _read(lib, img, 0, size, tmp_path, shift=100 if case == "unaligned" else 0)
    want, _ = _read(lib, img, 0, size, tmp_path, shift=100 if case == "unaligned" else 0, preload=False)
    assert rep == []
    assert (got["n"], got["sha"]) == (want["n"], want["sha"])
    assert got["n"] == min(size, len(data))


FAILING = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.preadv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_long]
libc.preadv.restype = ctypes.c_ssize_t
size = 4 << 20
addr = libc.mmap(None, size, 1, 0x22, -1, 0)  # PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS
class Iov(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
iov = Iov(addr, size)
fd = os.open(sys.argv[1], os.O_RDONLY)
n = libc.preadv(fd, ctypes.byref(iov), 1, 0)
print(n, ctypes.get_errno() if n < 0 else 0)
"""


def test_a_failed_read_fails_as_libcs_does(lib: Path, tmp_path: Path) -> None:
    """A buffer it cannot copy into and libc cannot write either (read-only memory): the read
    fails as libc's does (CRIU then fails the restore with its own error), never a success."""
    img, _ = _image(tmp_path)
    out = []
    for preload in (True, False):
        p = subprocess.run([sys.executable, "-c", FAILING, str(img)], capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, LD_PRELOAD=str(lib) if preload else "",
                                    PITSTOP_CRIUFILL_REPORT=str(tmp_path / "r")))
        assert p.returncode == 0, p.stderr
        out.append(p.stdout.split())
    assert out[0] == out[1] == ["-1", "14"]  # EFAULT both ways


def test_each_restore_gets_its_own_report_and_leaves_nothing(tmp_path: Path) -> None:
    try:
        rt = runtime.locate()
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no CRIU: {e}")
    if criufill.unavailable(rt):
        pytest.skip(criufill.unavailable(rt))
    stale = tmp_path / criufill.DIRNAME / "999999999-dead.report"  # an agent that died mid-restore
    stale.parent.mkdir(parents=True)
    stale.write_text("1 2 3\n")
    with criufill.preloaded(rt, tmp_path) as (a, ra), criufill.preloaded(rt, tmp_path) as (b, rb):
        assert ra != rb and dict(a.env)["PITSTOP_CRIUFILL_REPORT"] == str(ra)
        assert dict(b.env)["PITSTOP_CRIUFILL_REPORT"] == str(rb)
        assert not stale.exists()
        assert a.environ()["LD_PRELOAD"].split(":")[0] == str(criufill.library())
        ra.write_text("7 100 5 2\n8 50 0 1\nnot a line\n")
        assert criufill.read_report(ra) == (150, 5, 2)
        p = subprocess.run([a.binary, "--version"], capture_output=True, text=True, timeout=30, env=a.environ())
        assert p.returncode == 0 and "Version" in p.stdout
    assert list((tmp_path / criufill.DIRNAME).iterdir()) == []
    assert criufill.read_report(ra) == (0, 0, 0)

"""memory/writetrack.py with native/writetrack.c: the kernel says which pages a running process
wrote since its pre-copy began, and the process is left as it was (no userfaultfd of its own,
so CRIU can dump it).  Real processes, the real kernel interface; every mistake allowed is
toward "written" (a page sent again), never toward "unchanged"."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pitstop.memory import precopy, writetrack

from .helpers import WORKLOADS

LIB = Path(__file__).resolve().parents[1] / "native" / "build" / "libpitstop_writetrack.so"
WORKER = WORKLOADS / "writetrack_worker.py"
PAGE = 4096
pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(writetrack.unavailable() is not None, reason=str(writetrack.unavailable()))]


class Worker:
    def __init__(self, preload: bool = True, *args: str, user: int | None = None, lib: Path = LIB,
                 python: str = sys.executable, script: Path = WORKER) -> None:
        env = dict(os.environ, LD_PRELOAD=str(lib) if preload else "")
        self.p = subprocess.Popen([python, str(script), *args], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=env, user=user, group=user,
                                  extra_groups=[] if user is not None else None)
        self.base = int(self.p.stdout.readline(), 16)

    def __call__(self, *cmd: object) -> str:
        self.p.stdin.write(" ".join(map(str, cmd)) + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def uffds(self) -> int:
        return sum(1 for f in os.listdir(f"/proc/{self.p.pid}/fd")
                   if os.readlink(f"/proc/{self.p.pid}/fd/{f}") == "anon_inode:[userfaultfd]")

    def pages(self, regions: list[tuple[int, int]]) -> set[int]:
        """The buffer's page numbers among `regions`."""
        end = self.base + (16 << 20)
        return {(p - self.base) // PAGE for a, b in regions for p in range(max(a, self.base), min(b, end), PAGE)}

    def close(self) -> None:
        self.p.kill()
        self.p.wait(10)


@pytest.fixture
def worker():
    made: list[Worker] = []
    yield lambda *a, **k: made.append(Worker(*a, **k)) or made[-1]
    for w in made:
        w.close()


def test_exactly_the_pages_written_since_the_start_are_reported(worker):
    w = worker()
    tracked, why = writetrack.start([w.p.pid])
    assert list(tracked) == [w.p.pid] and not why, why
    t = tracked[w.p.pid]
    t.protect()
    try:
        assert t.registered_bytes >= 16 << 20
        assert w.uffds() == 0  # handed over: nothing CRIU would refuse to dump is left in it
        assert w.pages(t.written()) == set()
        for n in (5, 1000):
            w("write", n)
        w("kernel", 2000)  # written by a system call, not by the process's own stores
        assert w("drop", 3000) == "0"  # dropped and read back as zeros: changed, never "unchanged"
        new = int(w("new"), 16)
        assert w.pages(t.written()) == {5, 1000, 2000, 3000}
        assert any(a <= new < b for a, b in t.written())  # memory mapped since: all of it reads as written
        moved = int(w("move", 3500), 16)
        assert moved and moved != w.base + 3500 * PAGE
        assert any(a <= moved < b for a, b in t.written())  # moved by mremap: written at its new place
        assert w("write", 7) == "ok" and 7 in w.pages(t.written())
    finally:
        t.close()
    assert w("write", 8) == "ok" and w("fds") and w.p.poll() is None  # runs on after the tracking ends


def test_memory_mapped_since_reads_as_written_until_a_refresh_registers_it(worker):
    """A snapshot's interval begins with a refresh: memory the process mapped since the tracking
    started (a new malloc arena, a tensor's mmap) is registered then, so that from the next
    interval on only its pages written again count.  Before, such memory read as written at every
    snapshot, and a long-running rank's deltas grew toward its whole memory."""
    w = worker()
    tracked, why = writetrack.start([w.p.pid])
    t = tracked[w.p.pid]
    t.protect()
    try:
        new = int(w("new"), 16)  # mapped, one page touched, after the start
        assert any(a <= new < b for a, b in t.written())
        t.protect()  # a protect alone leaves it unregistered: still all written
        assert any(a <= new < b for a, b in t.written())
        t.refresh()
        assert not any(a <= new < b for a, b in t.written()), "registered and protected by the refresh"
        assert w.pages(t.written()) == set()
        w("write", 11)
        assert w.pages(t.written()) == {11}
    finally:
        t.close()


def test_a_process_without_the_library_is_not_signalled_and_says_why(worker):
    w = worker(False)
    tracked, why = writetrack.start([w.p.pid])
    assert tracked == {} and "libpitstop_writetrack.so is not loaded" in why[w.p.pid]
    assert w("write", 1) == "ok" and w.p.poll() is None  # the signal's default action would have killed it


def test_a_worker_that_answers_late_makes_no_userfaultfd(worker):
    """The signal is queued while the worker blocks it; once the agent has given up, the handler
    finds no socket and makes nothing, so a later dump is not refused."""
    w = worker(True, "--block")
    t0 = time.monotonic()
    tracked, why = writetrack.start([w.p.pid], timeout_s=0.5)
    assert tracked == {} and "did not answer within 0.5 s" in why[w.p.pid]
    assert time.monotonic() - t0 < 3
    assert w("unblock") == "ok"  # the handler runs now
    assert w("fds") and w.uffds() == 0 and w.p.poll() is None
    assert not any(writetrack.SOCKET_DIR.glob("*.sock"))


def test_many_processes_are_asked_at_once_and_each_gets_its_own(worker):
    ws = [worker() for _ in range(4)]
    t0 = time.monotonic()
    tracked, why = writetrack.start([w.p.pid for w in ws])
    try:
        assert set(tracked) == {w.p.pid for w in ws} and not why
        assert time.monotonic() - t0 < 2
        for t in tracked.values():
            t.protect()
        ws[2]("write", 42)
        assert [w.pages(tracked[w.p.pid].written()) for w in ws] == [set(), set(), {42}, set()]
    finally:
        for t in tracked.values():
            t.close()


@pytest.mark.slow
def test_overlapping_requests_leave_no_directory(worker):
    """The request that made /run/pitstop ends first, the other last: the last one out removes
    both directories (the maker could not: the other's socket was still in them)."""
    if writetrack.SOCKET_DIR.parent.exists():
        pytest.skip(f"{writetrack.SOCKET_DIR.parent} exists already (a systemd unit's RuntimeDirectory?)")
    first, second = worker(True, "--block"), worker(True, "--block")
    got: dict[str, object] = {}
    a = threading.Thread(target=lambda: got.update(a=writetrack.start([first.p.pid], timeout_s=0.5)))
    a.start()
    until = time.monotonic() + 2
    while not any(writetrack.SOCKET_DIR.glob("*.sock")) and time.monotonic() < until:
        time.sleep(0.005)
    b = threading.Thread(target=lambda: got.update(b=writetrack.start([second.p.pid], timeout_s=1.5)))
    b.start()
    a.join(5)
    assert writetrack.SOCKET_DIR.exists()  # the second request's socket is still there
    b.join(5)
    assert not writetrack.SOCKET_DIR.parent.exists()
    for w in (first, second):
        assert w("unblock") == "ok" and w.uffds() == 0


def test_a_stray_kill_of_the_signal_does_nothing(worker):
    """Only a queued signal (the agent's sigqueue) makes the handler act; kill(2) of the same
    number reaches the handler, which leaves the process as it was."""
    w = worker()
    os.kill(w.p.pid, writetrack.signal_number())
    assert w("fds") and w.uffds() == 0 and w.p.poll() is None


def test_a_worker_of_another_user_is_tracked_too(worker):
    """Tenants' workers need not run as root: the handler makes its userfaultfd for user-mode
    faults only (allowed without privilege) and reaches the agent's socket through its 0711
    directory, whatever the agent's umask."""
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no python3 outside root's home for user nobody to run")
    d = Path(tempfile.mkdtemp())
    old = os.umask(0o077)
    try:
        d.chmod(0o755)
        for f in (LIB, WORKER):
            shutil.copy(f, d / f.name)
            (d / f.name).chmod(0o755)
        w = worker(user=65534, lib=d / LIB.name, python=python, script=d / WORKER.name)
        tracked, why = writetrack.start([w.p.pid])
        assert list(tracked) == [w.p.pid] and not why, why
        tracked[w.p.pid].protect()
        try:
            w("write", 9)
            assert w.pages(tracked[w.p.pid].written()) == {9}
        finally:
            tracked[w.p.pid].close()
    finally:
        os.umask(old)
        shutil.rmtree(d)


def test_memory_never_touched_is_not_pre_copied_once_tracked(worker, tmp_path):
    """Protecting memory that was never touched leaves markers in its page table, which pagemap
    shows as swapped pages: a pre-copy that took them for pages read all of them, zeros, 857 MB
    more for two torch ranks in a bench run, and CRIU dumped them too, at the pause.  Only pages
    that exist are protected now, and the pre-copy knows a marker by its swap type."""
    w = worker()
    assert w("reserve") == "ok"  # 256 MiB mapped, never touched
    a, b = tmp_path / "plain", tmp_path / "tracked"
    a.mkdir()
    b.mkdir()
    plain = precopy.snapshot("w", [w.p.pid], a)
    tracked = precopy.snapshot("w", [w.p.pid], b, track=True)
    try:
        assert precopy.describe_basis(tracked)["tracked_tasks"] == 1, tracked.untracked
        assert abs(tracked.bytes - plain.bytes) < 4 << 20, (tracked.bytes, plain.bytes)
        assert plain.bytes < 64 << 20
        assert _markers(w.p.pid) == 0  # what CRIU would dump as zeros
        t = tracked.tasks[precopy.ns_pid(w.p.pid)].tracker
        w("write", 7)
        first = int(w("rtouch", 100), 16)  # left bare by the protection: its first write shows all the same
        assert w.pages(t.written()) == {7}
        assert any(a <= first < b for a, b in t.written())
    finally:
        tracked.close()


def test_a_write_into_huge_pages_is_seen(worker):
    """A transparent huge page is protected whole; a write to one of its 4 KiB pages may mark
    all 2 MiB written (more sent again), never none of it."""
    w = worker()
    base = int(w("huge"), 16)
    huge_kib = _anon_huge_kib(w.p.pid)
    tracked, why = writetrack.start([w.p.pid])
    assert list(tracked) == [w.p.pid] and not why, why
    t = tracked[w.p.pid]
    t.protect()
    try:
        assert not any(a < base + (4 << 20) and base < b for a, b in t.written())
        w("hwrite", 600)  # in the second 2 MiB
        target = base + 600 * PAGE
        hit = [(a, b) for a, b in t.written() if a < base + (4 << 20) and base < b]
        assert any(a <= target < b for a, b in hit), (hit, hex(target), huge_kib)
        assert all(a >= base + (2 << 20) for a, b in hit)  # the first 2 MiB, not written, stays unchanged
    finally:
        t.close()


def _anon_huge_kib(pid: int) -> int:
    """AnonHugePages of the process (0 where the kernel gave it none: the test holds either way)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")), 0)


def _markers(pid: int) -> int:
    """Page-table entries of the process that are PTE markers (swapped, swap type 31)."""
    pm = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    n = 0
    try:
        with open(f"/proc/{pid}/maps") as f:
            spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f
                     if not line.rstrip().endswith("[vsyscall]")]
        for a, b in spans:
            e = np.frombuffer(os.pread(pm, (b - a) // PAGE * 8, a // PAGE * 8), dtype=np.uint64)
            n += int(np.count_nonzero(((e >> np.uint64(62)) & np.uint64(1)).astype(bool)
                                      & ((e & np.uint64(31)) == np.uint64(31))))
    finally:
        os.close(pm)
    return n

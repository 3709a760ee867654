"""Pre-copy (memory/precopy.py) against real CRIU: copy a running process's memory ahead, dump it
once paused, send only what changed, restore from the delta with the pre-copy as its parent.

Each case is a tiny process with an invariant (zdtm's way): it holds 64 MiB of numbered pages
and reports a digest of all its memory on SIGUSR2; the restored copy must report the same
digest as the original did just before its dump, whether memory changed after the pre-copy
or not, restored eagerly (CRIU reads the parent) or lazily (pitstop's local page server answers
CRIU's daemon from both files, memory/lazydelta.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pitstop.criu import criu_ops, criufill, criutrack, netlock, runtime
from pitstop.memory import lazy_pages, lazydelta, precopy
from pitstop.proc import proctree

HOLDER = r"""
import hashlib, mmap, os, signal, sys, time
out = sys.argv[1]
MB = 1 << 20
m = mmap.mmap(-1, 64 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, len(m), 4096):
    m[i:i + 8] = i.to_bytes(8, "little")
extra = []
todo = []
signal.signal(signal.SIGUSR1, lambda *a: todo.append("change"))
signal.signal(signal.SIGUSR2, lambda *a: todo.append("report"))
n = 0
print("ready", flush=True)
sys.stdout.close()
while True:
    while todo:
        what = todo.pop(0)
        n += 1
        if what == "change":  # 1 MiB rewritten in place, 2 MiB of new memory, one page at 40 MiB
            m[MB:2 * MB] = os.urandom(MB)
            m[40 * MB + 100:40 * MB + 108] = b"changed!"
            e = mmap.mmap(-1, 2 * MB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            e[:] = os.urandom(2 * MB)
            extra.append(e)
        h = hashlib.sha256(m)
        for e in extra:
            h.update(e)
        with open(f"{out}.{n}", "w") as f:
            f.write(h.hexdigest())
    time.sleep(0.01)
"""


def _wait_file(p: Path, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.exists() and p.stat().st_size == 64:
            return p.read_text()
        time.sleep(0.02)
    raise AssertionError(f"{p} never appeared")


def _kill_tree(pid: int) -> None:
    for p in reversed(proctree.tree(pid)):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


WRITETRACK = Path(__file__).resolve().parents[1] / "native" / "build" / "libpitstop_writetrack.so"


@dataclass
class _Held:
    """A test process started with the write-tracking library in a pid namespace of its own,
    dumped and restored by the test; `held()` removes whatever of it exists at the end."""

    p: subprocess.Popen
    root: int = 0
    run_id: str = ""
    restored: int | None = None

    def pre_copy(self, tmp: Path) -> tuple[precopy.Basis, Path, Path]:
        """A tracked pre-copy into tmp/pre: (its basis, where the dump goes, where the delta goes)."""
        (tmp / "pre").mkdir()
        basis = precopy.snapshot("w", proctree.tree(self.root), tmp / "pre", track=True)
        assert precopy.describe_basis(basis)["tracked_tasks"] == 1, basis.untracked
        return basis, tmp / "images", tmp / "view"

    def restore(self, view: Path) -> None:
        """End the original (and its network lock), then restore the dump from `view`."""
        _kill_tree(self.p.pid)
        self.p.wait(10)
        netlock.release(self.run_id)
        self.run_id = ""
        self.restored, _ = criu_ops.restore(view, {})


@contextlib.contextmanager
def held(script: str, report: Path) -> Iterator[_Held]:
    h = _Held(subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, "-c", script, str(report)],
                               stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=dict(os.environ, LD_PRELOAD=str(WRITETRACK))))
    try:
        assert h.p.stdout.readline().strip() == b"ready"  # type: ignore[union-attr]
        h.root = proctree.children(h.p.pid)[0]
        yield h
    finally:
        if h.restored:
            _kill_tree(h.restored)
        if h.run_id:
            netlock.release(h.run_id)
        _kill_tree(h.p.pid)
        h.p.wait(10)


def _incremental_dump(root: int, images: Path, basis: precopy.Basis) -> criu_ops.DumpResult:
    """CRIU's own incremental dump against the pre-copy in ../pre (criu/criutrack.py)."""
    command, why = criutrack.command()
    assert command, why
    res = criu_ops.dump(root, images, criu_ops.DumpOptions(parent="../pre", command=command,
                                                           log_level=criutrack.LOG_LEVEL))
    basis.close()
    assert os.readlink(images / "parent") == "../pre"
    assert sum(f.stat().st_size for f in images.glob("pages-*.img")) == res.pages_written * precopy.PAGE
    return res


@pytest.mark.timeout(180)
@pytest.mark.parametrize("change,lazy,tracked", [(False, False, False), (True, False, False), (True, True, False),
                                                 (False, False, True), (True, False, True), (True, True, True),
                                                 (False, False, "criu"), (True, False, "criu"), (True, True, "criu")],
                         ids=["unchanged", "changed", "changed-lazy",
                              "unchanged-tracked", "changed-tracked", "changed-lazy-tracked",
                              "unchanged-criu", "changed-criu", "changed-lazy-criu"])
def test_restore_from_a_delta_and_its_pre_copy_is_the_process_as_dumped(tmp_path: Path, change: bool,
                                                                        lazy: bool, tracked: bool | str) -> None:
    """Tracked: the kernel says what was written (memory/writetrack.py) instead of the digests.
    "criu": and CRIU's own incremental dump writes only that, the rest left in the pre-copy as
    its parent (criu/criutrack.py), instead of pitstop cutting the delta out of a full dump."""
    report = tmp_path / "digest"
    env = dict(os.environ, LD_PRELOAD=str(WRITETRACK)) if tracked else None
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, "-c", HOLDER, str(report)],
                         stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    run_id, restored, fill = "", None, None
    try:
        assert p.stdout.readline().strip() == b"ready"
        root = proctree.children(p.pid)[0]
        pre, images, view = tmp_path / "pre", tmp_path / "images", tmp_path / "view"
        pre.mkdir()
        basis = precopy.snapshot("w", proctree.tree(root), pre, track=tracked)
        assert basis.bytes >= 64 << 20 and set(basis.tasks) == {1}  # named as in its own namespace
        assert precopy.describe_basis(basis)["tracked_tasks"] == (1 if tracked else 0), basis.untracked
        os.kill(root, signal.SIGUSR1 if change else signal.SIGUSR2)
        before = _wait_file(Path(f"{report}.1"))
        if tracked == "criu":
            res = _incremental_dump(root, images, basis)
            run_id, view = res.run_id, images
            changed, in_parent = res.pages_written * precopy.PAGE, res.pages_in_parent * precopy.PAGE
        else:
            run_id = criu_ops.dump(root, images).run_id
            delta = precopy.rewrite(images, view, basis)
            assert (delta.tracked_tasks, delta.digested_tasks) == ((1, 0) if tracked else (0, 1))
            changed, in_parent = delta.changed_bytes, delta.parent_bytes
            full = sum(f.stat().st_size for f in images.glob("pages-*.img"))
            assert sum(f.stat().st_size for f in view.glob("pages-*.img")) == delta.changed_bytes
            assert full == delta.changed_bytes + delta.parent_bytes
            (view / "parent").symlink_to(Path("..") / "pre")
        if change:  # 1 MiB rewritten, a page (its 64 KiB block) changed, 2 MiB new; Python's own heap moves too
            assert 3 << 20 <= changed < 12 << 20, (changed, in_parent)
        else:
            assert changed < 4 << 20, (changed, in_parent)
        assert in_parent >= 60 << 20
        _kill_tree(p.pid)
        p.wait(10)
        netlock.release(run_id)
        run_id = ""
        if lazy:  # no parent for CRIU's daemon: pitstop's local page server answers it from both files
            lv = tmp_path / "lazy"
            split = lazydelta.view(view, pre, lv)
            assert split.lazy_bytes >= 60 << 20
            assert {fi for t in split.tasks.values() for *_, fi in t.entries} == {lazydelta.DELTA, lazydelta.PARENT}
            assert not (lv / "parent").exists()
            fill = lazy_pages.start(lv, local_index=lv / lazydelta.INDEX)
            restored, _ = criu_ops.restore(lv, {}, lazy=True)
            assert fill.guard(restored) is None
        elif tracked:  # CRIU's reads of the parent's pages by UFFDIO_COPY, as the agent restores (criufill.py)
            rt = runtime.locate()
            assert not criufill.unavailable(rt), criufill.unavailable(rt)
            with criufill.preloaded(rt, tmp_path / "state") as (command, filled):
                restored, _ = criu_ops.restore(view, {}, command=command)
                copied, left, _ = criufill.read_report(filled)
            assert copied >= 60 << 20, (copied, left)
        else:
            restored, _ = criu_ops.restore(view, {})
        os.kill(restored, signal.SIGUSR2)
        after = _wait_file(Path(f"{report}.2"))
        assert after == before
        if fill:
            ok, why = fill.wait(60)
            assert ok, why
            verdict = json.loads((lv / lazy_pages.RELAY_RESULT).read_text())
            assert verdict["ok"] and verdict["bytes"] >= 60 << 20, verdict
    finally:
        if restored:
            _kill_tree(restored)
        if fill:
            fill.kill()
        if run_id:
            netlock.release(run_id)
        _kill_tree(p.pid)
        p.wait(10)


def test_a_process_that_began_to_use_a_gpu_is_cut_by_digest(tmp_path: Path) -> None:
    """Its writes were tracked from the pre-copy on, then it began to use a GPU: the device may
    have written memory it pinned, unseen by the page tables.  distrust() drops its tracking; the
    digests taken with the pre-copy cut its delta instead, and the restore is still the process."""
    report = tmp_path / "digest"
    with held(HOLDER, report) as h:
        basis, images, view = h.pre_copy(tmp_path)
        assert basis.distrust({h.root + 1_000_000}, "no such pid") == 0  # another process's pid: kept
        assert basis.distrust({h.root}, "it began to use a GPU after its pre-copy") == 1
        assert basis.untracked == {h.root: "it began to use a GPU after its pre-copy"} and not basis.fully_tracked()
        os.kill(h.root, signal.SIGUSR2)
        before = _wait_file(Path(f"{report}.1"))
        h.run_id = criu_ops.dump(h.root, images).run_id
        delta = precopy.rewrite(images, view, basis)
        full = sum(f.stat().st_size for f in images.glob("pages-*.img"))
        assert (delta.tracked_tasks, delta.digested_tasks) == (0, 1)
        assert delta.changed_bytes + delta.parent_bytes == full and delta.parent_bytes >= 60 << 20
        (view / "parent").symlink_to(Path("..") / "pre")
        h.restore(view)
        os.kill(h.restored, signal.SIGUSR2)  # type: ignore[arg-type]
        assert _wait_file(Path(f"{report}.2")) == before


BUSY = r"""
import hashlib, mmap, os, random, signal, sys, time
out = sys.argv[1]
m = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m[:] = b"\1" * len(m)
stop = []
signal.signal(signal.SIGUSR1, lambda *a: stop.append(1))
signal.signal(signal.SIGUSR2, lambda *a: stop.append(2))
print("ready", flush=True)
sys.stdout.close()
r, n = random.Random(1), 0
while 1 not in stop:  # writes all over its memory, the whole time it is being read
    p = r.randrange(len(m) // 4096) * 4096
    m[p:p + 8] = n.to_bytes(8, "little")
    n += 1
k = 0
while True:
    if 2 in stop or k == 0:
        k += 1
        stop[:] = [1]
        with open(f"{out}.{k}", "w") as f:
            f.write(hashlib.sha256(m).hexdigest())
    time.sleep(0.01)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("by", ["pitstop", "criu"])
def test_pages_written_while_they_are_read_travel_again(tmp_path: Path, by: str) -> None:
    """The race the tracking must win: the process writes its memory all through the pre-copy;
    every page written after its protection is reported, so the restored copy is the dumped one.
    by: who cuts the delta (pitstop out of a full dump, or CRIU's incremental dump)."""
    report = tmp_path / "digest"
    with held(BUSY, report) as h:
        basis, images, view = h.pre_copy(tmp_path)
        os.kill(h.root, signal.SIGUSR1)
        before = _wait_file(Path(f"{report}.1"))
        if by == "criu":
            res = _incremental_dump(h.root, images, basis)
            h.run_id, view = res.run_id, images
            assert res.pages_written >= 64 and res.pages_in_parent > 0, res.stats
        else:
            h.run_id = criu_ops.dump(h.root, images).run_id
            delta = precopy.rewrite(images, view, basis)
            assert delta.tracked_tasks == 1 and delta.changed_bytes >= 64 * 4096, precopy.describe_delta(delta)
            assert delta.parent_bytes > 0
            (view / "parent").symlink_to(Path("..") / "pre")
        h.restore(view)
        os.kill(h.restored, signal.SIGUSR2)  # type: ignore[arg-type]
        assert _wait_file(Path(f"{report}.2")) == before


def test_unchanged_is_what_was_copied_less_what_was_written() -> None:
    P = precopy.PAGE
    have = [(0, 10 * P), (20 * P, 30 * P)]
    assert precopy._subtract(have, []) == have
    assert precopy._subtract(have, [(2 * P, 3 * P), (9 * P, 21 * P), (29 * P, 40 * P)]) == \
        [(0, 2 * P), (3 * P, 9 * P), (21 * P, 29 * P)]
    unchanged = [(0, 2 * P), (3 * P, 9 * P)]
    assert precopy._cut([a for a, _ in unchanged], unchanged, P, 12 * P) == \
        [(P, 1, True), (2 * P, 1, False), (3 * P, 6, True), (9 * P, 3, False)]


@pytest.mark.timeout(60)
@pytest.mark.timeout(60)
def test_a_stopped_snapshot_ends_at_its_next_read_and_says_why(tmp_path: Path) -> None:
    """`stop` is how a pre-copy nobody waits for any more is ended (DELETE /v1/precopies/{id}):
    the snapshot must end at its next 4 MiB read, not after the whole memory."""
    import threading

    from pitstop.errors import CaptureFailed
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "digest")],
                         stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert p.stdout.readline().strip() == b"ready"
        stop = threading.Event()
        stop.set()
        with pytest.raises(CaptureFailed) as e:
            precopy.snapshot("w", [p.pid], tmp_path, stop=stop)
        assert e.value.code == "aborted" and e.value.http_status == 409, e.value.to_dict()
        written = sum(f.stat().st_size for f in tmp_path.glob("pages-*.img"))
        assert written < precopy.READ_CHUNK, written  # not one read past the stop
        assert p.poll() is None  # the worker never noticed
    finally:
        p.kill()
        p.wait(10)


def test_a_page_not_pre_copied_or_changed_travels_in_the_delta() -> None:
    """The cut itself, without CRIU: whole blocks go by block digest, the rest page by page."""
    d = precopy.TaskDigests()
    data = bytearray(os.urandom(precopy.BLOCK * 3))
    base = 0x7F0000000000
    precopy._digest_run(d, base + precopy.PAGE, memoryview(bytes(data[precopy.PAGE:])))  # first page not copied
    assert set(d.blocks) == {base + precopy.BLOCK, base + 2 * precopy.BLOCK}
    assert len(d.pages) == precopy.BLOCK_PAGES - 1
    data[precopy.BLOCK + 5] ^= 1  # a byte in the second block
    data[3 * precopy.PAGE] ^= 1  # a byte in a page of the first (partial) block
    runs = precopy._runs(d, base, memoryview(bytes(data)))
    assert runs == [(base, 1, False), (base + precopy.PAGE, 2, True), (base + 3 * precopy.PAGE, 1, False),
                    (base + 4 * precopy.PAGE, 12, True), (base + precopy.BLOCK, 16, False),
                    (base + 2 * precopy.BLOCK, 16, True)]
    assert precopy._runs(None, base, memoryview(bytes(data))) == [(base, 48, False)]


def test_entries_join_where_they_touch_and_agree() -> None:
    P, L = precopy.PE_PRESENT, precopy.PE_LAZY
    hole = {"vaddr": 0x30000, "nr_pages": 4, "flags": L}
    es = [{"vaddr": 0x10000, "nr_pages": 4, "flags": P}, {"vaddr": 0x14000, "nr_pages": 4, "flags": P},
          {"vaddr": 0x18000, "nr_pages": 2, "flags": P | L}, hole, {"vaddr": 0x40000, "nr_pages": 1, "flags": P},
          {"vaddr": 0x50000, "nr_pages": 1, "flags": P}]
    assert precopy._groups(es) == [(0x10000, 8, P), (0x18000, 2, P | L), hole, (0x40000, 1, P), (0x50000, 1, P)]


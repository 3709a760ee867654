"""pitstop's own lazy marks (memory/lazyrule.py): CRIU marks no page lazy when a thread's stack
pointer is page-aligned at the dump; pitstop marks them as CRIU meant to.

Invariants: on a real dump of a worker with such a thread, CRIU's pagemap has no lazy page and
pitstop's marks make its anonymous memory lazy; on a plain dump the two agree on every page but
the stack pages; and such a worker moves post-copy (over the network and from a local copy),
its memory intact, with the lazy pages really left for after the restore.
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pitstop.criu import criu_ops, runtime
from pitstop.memory import dumpview, lazyrule
from pitstop.memory.dumpview import PAGE, PE_LAZY, PE_PRESENT
from pitstop.migration.move import move_worker

from .helpers import WORKLOADS, end_dumped, until, wait_for_step

WORKER = WORKLOADS / "aligned_stack.py"
MB = 16
x86_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="the parked thread is x86-64 code")


# -- the rule, as logic --------------------------------------------------------------------------

def _vma(start: int, end: int, flags: int = lazyrule.MAP_PRIVATE | lazyrule.MAP_ANONYMOUS, status: int = 1):  # noqa: ANN202
    return SimpleNamespace(start=start, end=end, flags=flags, status=status)  # a vma_entry's fields


@pytest.mark.parametrize("flags,status,lazy", [
    (0x22, 0x201, True),                                  # private anonymous
    (0x02, 0x41, False),                                  # private file-backed: placed by the restore
    (0x21, 0x101, False),                                 # shared anonymous
    (0x22 | lazyrule.MAP_LOCKED, 0x201, False),
    (0x22 | lazyrule.MAP_HUGETLB, 0x201, False),
    (0x22, 0x201 | lazyrule.VMA_AREA_VDSO, False),
    (0x22, 0x201 | lazyrule.VMA_AREA_VVAR, False),
    (0x22, 0x201 | lazyrule.VMA_AREA_VSYSCALL, False),
])
def test_the_vmas_a_lazy_restore_may_leave_out_are_criu_s(flags, status, lazy):
    assert lazyrule.vma_can_be_lazy(_vma(0, PAGE, flags, status)) is lazy


def test_runs_cut_where_laziness_changes_and_cover_the_range_once():
    base = 0x10000000
    rule = lazyrule.LazyRule(spans=[(base, base + 8 * PAGE), (base + 12 * PAGE, base + 20 * PAGE)],
                             pinned=frozenset({base + 3 * PAGE, base + 19 * PAGE}))
    runs = list(rule.runs(base - 2 * PAGE, 24))
    assert runs == [(base - 2 * PAGE, 2, False), (base, 3, True), (base + 3 * PAGE, 1, False),
                    (base + 4 * PAGE, 4, True), (base + 8 * PAGE, 4, False), (base + 12 * PAGE, 7, True),
                    (base + 19 * PAGE, 3, False)]
    assert list(rule.runs(base + 4 * PAGE, 2)) == [(base + 4 * PAGE, 2, True)]
    assert list(rule.runs(base + 3 * PAGE, 1)) == [(base + 3 * PAGE, 1, False)]


def test_relabel_keeps_the_pages_in_order_and_counts_what_changed():
    base = 0x20000000
    rule = lazyrule.LazyRule(spans=[(base, base + 6 * PAGE)], pinned=frozenset({base + 2 * PAGE}))
    entries = [{"vaddr": base - PAGE, "nr_pages": 4, "flags": PE_PRESENT, "compat_nr_pages": 0},
               {"vaddr": base + 3 * PAGE, "nr_pages": 3, "flags": PE_PRESENT | PE_LAZY, "compat_nr_pages": 0},
               {"vaddr": base + 9 * PAGE, "nr_pages": 2, "flags": 0}]  # a hole: untouched
    out, changed = lazyrule.relabel(entries, rule)
    assert [(e["vaddr"] - base) // PAGE for e in out] == [-1, 0, 2, 3, 9]
    assert [e["nr_pages"] for e in out] == [1, 2, 1, 3, 2]
    assert [bool(e["flags"] & PE_LAZY) for e in out] == [False, True, False, True, False]
    assert all(e["flags"] & PE_PRESENT for e in out[:4]) and out[4] is entries[2]
    assert (changed.made_lazy, changed.made_eager) == (2, 0)


# -- against real dumps --------------------------------------------------------------------------

def _dump(tmp_path: Path, *extra: str) -> Path:
    out = tmp_path / "worker.log"
    with open(out, "w") as f:
        p = subprocess.Popen(["setsid", sys.executable, str(WORKER), "10000", str(MB), *extra],
                             stdout=f, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    run_id = ""
    try:
        until(lambda: "step 1 ok" in out.read_text() or p.poll() is not None, what="the worker's first step")
        assert p.poll() is None, out.read_text()
        images = tmp_path / "images"
        run_id = criu_ops.dump(p.pid, images).run_id  # left stopped: killed below
        return images
    finally:
        end_dumped(p, run_id)


def _pages(entries: list[dict], flag: int) -> set[int]:
    return {int(e["vaddr"]) + k * PAGE for e in entries if int(e["flags"]) & flag for k in range(int(e["nr_pages"]))}


def _both(images: Path) -> tuple[list[dict], list[dict], lazyrule.LazyRule]:
    pycriu = runtime.locate().import_pycriu()
    (criu,) = list(dumpview.task_images(images, pycriu))
    (ours,) = list(lazyrule.task_images(images, pycriu))
    return criu.entries, ours.task.entries, lazyrule.load(images, criu.pid, pycriu)


@x86_only
@pytest.mark.timeout(120)
def test_criu_marks_nothing_lazy_under_an_aligned_stack_pointer_and_pitstop_does(tmp_path):
    criu, ours, rule = _both(_dump(tmp_path))
    assert _pages(criu, PE_PRESENT) and not _pages(criu, PE_LAZY)  # the premise: CRIU's stack test
    assert any(p % PAGE == 0 for p in rule.pinned)
    lazy = _pages(ours, PE_LAZY)
    assert len(lazy) * PAGE >= MB << 20
    assert _pages(ours, PE_PRESENT) == _pages(criu, PE_PRESENT)  # the same pages, only their marks differ
    assert not lazy & rule.pinned


@x86_only
@pytest.mark.timeout(120)
def test_on_a_plain_dump_pitstop_and_criu_differ_only_on_stack_pages(tmp_path):
    criu, ours, rule = _both(_dump(tmp_path, "--no-park"))
    theirs, mine = _pages(criu, PE_LAZY), _pages(ours, PE_LAZY)
    assert len(theirs) * PAGE >= MB << 20
    # CRIU's rule but for its stack test: the stack pages it marked lazy (the main thread's at least) are eager
    assert mine == theirs - rule.pinned and theirs & rule.pinned


# -- moves ----------------------------------------------------------------------------------------

def _start(cluster, src_env: dict | None = None, dst_env: dict | None = None):  # noqa: ANN202
    with cluster.starting():
        a = cluster.start_agent("a", env=src_env or {})
        b = cluster.start_agent("b", spare=True, env=dst_env or {})
    (rank,) = cluster.start_job("s", [sys.executable, str(WORKER), "160", str(MB)], 1, {0: "a"})
    cluster.wait_registered("a", "s.0")
    wait_for_step(rank.log, 5)
    return a, b, rank


def _ends_intact(rank) -> None:  # noqa: ANN001
    assert rank.proc.wait(120) == 0, rank.log.read_text()[-1500:]
    log = rank.log.read_text()
    assert "BAD" not in log and "step 160 ok" in log and "done" in log


@x86_only
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_it_moves_post_copy_over_the_network_with_its_memory_lazy(cluster):
    a, b, rank = _start(cluster)
    rep = move_worker(a.client(), b.client(), "s.0", dest_name="b", peers=[], post_copy=True)
    pc = a.client().get_capture(rep.capture_id).post_copy
    assert pc["lazy_bytes"] >= MB << 20 and pc["made_lazy_bytes"] >= MB << 20, pc  # CRIU would have sent it whole
    until(lambda: "memory filled" in b.log.read_text(errors="replace"))
    _ends_intact(rank)


@x86_only
@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_it_restores_lazily_from_a_local_copy_with_its_memory_lazy(cluster):
    a, b, rank = _start(cluster, dst_env={"PITSTOP_AGENT_LAZY_RESTORE": "1"})
    move_worker(a.client(), b.client(), "s.0", dest_name="b", peers=[])
    until(lambda: "memory filled" in b.log.read_text(errors="replace"))
    marked = re.findall(r"pitstop marked pages lazy that CRIU did not.*?made_lazy_bytes=(\d+)",
                        b.log.read_text(errors="replace"))
    assert marked and int(marked[-1]) >= MB << 20, marked
    _ends_intact(rank)

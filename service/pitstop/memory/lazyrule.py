"""Which pages of a dumped task a lazy restore may leave out, decided by pitstop, not read from CRIU.

CRIU marks a page PE_LAZY when its VMA can be restored lazily and it is not a thread's stack
page (criu/mem.c, generate_iovs).  Its stack test is wrong: `is_stack` compares
`(sp ^ vaddr) & ~PAGE_MASK`, the offset *within* the page, where the page number was meant
(`& PAGE_MASK`; CRIU commit 1bc68dd87, 2019, turned the right mask into this one).  Since every
vaddr it tests is page-aligned, the test is true for every page once any thread's stack
pointer happens to be page-aligned at the dump, and then CRIU marks nothing lazy at all; it
is false otherwise, stack pages included.  How often: the main thread's stack starts at a
random 16-byte offset in its page (235 different offsets in 600 fresh processes here), so its
stack pointer is page-aligned in about one process in 256; the other threads' stacks are
page-aligned mappings, so an idle thread's offset is the same in every dump (0 of 400 dumps
of one torch process with 16 threads).  Such a dump's post-copy silently becomes a full copy
before the restore (seen twice in full test runs on 2026-12-01; reproduced at will in
tests/test_lazy_rule.py).

So pitstop applies the rule CRIU meant, from the dump's own images: a page is lazy when its
VMA is one CRIU's restorer registers with userfaultfd (`vma_entry_can_be_lazy`: private
anonymous, not locked, not huge-TLB, not vDSO, vvar or vsyscall) and it is not the page holding
a thread's stack pointer, or the one below it that the red zone may reach.  Where a task's
stack pointers cannot be read (an architecture this does not know), CRIU's marks stand.
"""

from __future__ import annotations

import bisect
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pitstop.memory import cowpages
from pitstop.memory.dumpview import PAGE, PE_COW, PE_LAZY, PE_PARENT, PE_PRESENT, TaskImage, dump_pagemap, link_the_rest
from pitstop.memory.dumpview import task_images as criu_task_images

MAP_PRIVATE, MAP_ANONYMOUS, MAP_LOCKED, MAP_HUGETLB = 0x02, 0x20, 0x2000, 0x40000
VMA_AREA_VSYSCALL, VMA_AREA_VDSO, VMA_AREA_VVAR = 1 << 2, 1 << 3, 1 << 12
RED_ZONE = 128  # x86-64 ABI: a leaf function may keep data this far below its stack pointer
THREAD_INFO = ("thread_info", "ti_aarch64")  # core_entry's registers, per architecture (x86-64, aarch64)


def vma_can_be_lazy(vma: Any) -> bool:
    """CRIU's `vma_entry_can_be_lazy` (criu/include/vma.h): the VMAs its restorer hands to the
    lazy-pages daemon.  A page outside them must be in the pages file, or it is restored as zeros.
    `vma`: a vma_entry message."""
    flags, status = int(vma.flags), int(vma.status)
    return bool(flags & MAP_ANONYMOUS and flags & MAP_PRIVATE and not flags & (MAP_LOCKED | MAP_HUGETLB)
                and not status & (VMA_AREA_VDSO | VMA_AREA_VVAR | VMA_AREA_VSYSCALL))


@dataclass
class LazyRule:
    """One task's rule: the sorted (start, end) of its lazy-capable VMAs, merged where they touch,
    and the pages kept eager within them (stack pages)."""

    spans: list[tuple[int, int]]
    pinned: frozenset[int]

    def runs(self, vaddr: int, n: int) -> Iterator[tuple[int, int, bool]]:
        """[vaddr, vaddr + n pages) cut where laziness changes: (vaddr, pages, lazy)."""
        end = vaddr + n * PAGE
        i = max(0, bisect.bisect_right(self.spans, (vaddr, 1 << 64)) - 1)
        if self.spans and self.spans[i][0] <= vaddr and end <= self.spans[i][1] \
                and not any(vaddr <= p < end for p in self.pinned):  # the common case: one lazy run
            yield vaddr, n, True
            return
        cuts = {vaddr, end}
        for start, stop in self.spans[i:]:
            if start >= end:
                break
            cuts |= {start, stop}
        for p in self.pinned:
            cuts |= {p, p + PAGE}
        points = sorted(c for c in cuts if vaddr <= c <= end)
        run: list = []
        for a, b in zip(points, points[1:]):
            lazy = self.lazy(a)
            if run and run[2] == lazy:
                run[1] = b
                continue
            if run:
                yield run[0], (run[1] - run[0]) // PAGE, run[2]
            run = [a, b, lazy]
        if run:
            yield run[0], (run[1] - run[0]) // PAGE, run[2]

    def lazy(self, vaddr: int) -> bool:
        i = bisect.bisect_right(self.spans, (vaddr, 1 << 64)) - 1
        return i >= 0 and self.spans[i][0] <= vaddr < self.spans[i][1] and vaddr not in self.pinned


def stack_pointer(core: Any) -> int | None:
    """The stack pointer in a core_entry message (x86-64 or aarch64), or None."""
    for field_name in THREAD_INFO:
        try:
            if core.HasField(field_name):
                return int(getattr(core, field_name).gpregs.sp)
        except ValueError:  # a pycriu without this architecture's field
            continue
    return None


def first_entry(path: Path, pycriu: Any) -> Any:
    """The first entry of a CRIU image as its protobuf message.  pycriu.images.load turns every
    field into a dict, which cost 22 ms for one torch rank's 16 core images and its mm image
    (hundreds of VMAs), inside the pause; the message itself is parsed in C."""
    images = pycriu.images.images
    magic = pycriu.images.magic
    with open(path, "rb") as f:
        (m,) = struct.unpack("i", f.read(4))
        if m in (magic.by_name["IMG_COMMON"], magic.by_name["IMG_SERVICE"]):
            (m,) = struct.unpack("i", f.read(4))
        msg = images.handlers[magic.by_val[m]].payload()
        (size,) = struct.unpack("i", f.read(4))
        msg.ParseFromString(f.read(size))
    return msg


def threads_of(images: Path, pycriu: Any) -> dict[int, list[int]]:
    """Each task's thread ids, from the dump's pstree (read once for all its tasks)."""
    with open(images / "pstree.img", "rb") as f:
        tree = pycriu.images.load(f, pretty=False)["entries"]
    return {int(t["pid"]): [int(x) for x in t.get("threads") or [t["pid"]]] for t in tree}


def load(images: Path, pid: int, pycriu: Any, threads: list[int] | None = None) -> LazyRule | None:
    """The rule for task `pid` of the dump in `images`, or None where its threads' stack pointers
    cannot be read (then CRIU's marks are kept).  threads: the task's, if already read."""
    if threads is None:
        threads = threads_of(images, pycriu).get(pid, [pid])
    pinned: set[int] = set()
    for tid in threads:
        sp = stack_pointer(first_entry(images / f"core-{tid}.img", pycriu))
        if sp is None:
            return None
        pinned |= {sp & ~(PAGE - 1), (sp - RED_ZONE) & ~(PAGE - 1)}
    spans: list[tuple[int, int]] = []
    for v in sorted((v for v in first_entry(images / f"mm-{pid}.img", pycriu).vmas if vma_can_be_lazy(v)),
                    key=lambda v: v.start):
        start, end = int(v.start), int(v.end)
        if spans and spans[-1][1] == start:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return LazyRule(spans=spans, pinned=frozenset(pinned))


@dataclass
class Relabelled:
    """What the rule changed against CRIU's marks, in pages: for the log and the capture's record."""

    made_lazy: int = 0
    made_eager: int = 0


def relabel(entries: list[dict[str, Any]], rule: LazyRule) -> tuple[list[dict[str, Any]], Relabelled]:
    """The task's pagemap entries with PE_LAZY set by `rule`, cut where it changes within one.

    Only entries with pages in this dump (PE_PRESENT), in its parent (PE_PARENT: a delta, whose
    lazy restore reads them from the pre-copy, memory/lazydelta.py) or in the parent task's
    (PE_COW: cowpages.py then matches them to the parent's marks) are touched; their pages stay
    in the same order in the pages file, so every offset holds."""
    out: list[dict[str, Any]] = []
    changed = Relabelled()
    for e in entries:
        flags = int(e["flags"])
        if not flags & (PE_PRESENT | PE_PARENT | PE_COW):
            out.append(e)
            continue
        was = bool(flags & PE_LAZY)
        for va, n, lazy in rule.runs(int(e["vaddr"]), int(e["nr_pages"])):
            if lazy != was:
                if lazy:
                    changed.made_lazy += n
                else:
                    changed.made_eager += n
            out.append({**e, "vaddr": va, "nr_pages": n, "flags": (flags | PE_LAZY) if lazy else (flags & ~PE_LAZY)})
    return out, changed


@dataclass
class RelabelledTask:
    """A task's pagemap with pitstop's lazy marks (`task.entries` and `task.image` agree), and
    what changed against CRIU's."""

    task: TaskImage
    changed: Relabelled = field(default_factory=Relabelled)


def task_images(images: Path, pycriu: Any) -> Iterator[RelabelledTask]:
    """dumpview.task_images, each task relabelled by its rule (as CRIU marked it where no rule
    can be read); then the pages a child shares with its parent (PE_COW), and the parent's pages
    they name, made eager (cowpages.py)."""
    threads = threads_of(images, pycriu)
    marked: list[RelabelledTask] = []
    for t in criu_task_images(images, pycriu):
        rule = load(images, t.pid, pycriu, threads.get(t.pid, [t.pid]))
        if rule is None:
            marked.append(RelabelledTask(t))  # CRIU's marks, unchanged
            continue
        entries, changed = relabel(t.entries, rule)
        marked.append(RelabelledTask(replace(t, entries=entries, image={**t.image, "entries": [t.head, *entries]}),
                                     changed))
    if any(int(e["flags"]) & PE_COW for m in marked for e in m.task.entries):
        adjusted = cowpages.like_parents({m.task.pid: m.task.entries for m in marked},
                                         cowpages.parents_of(images, pycriu))
        for i, m in enumerate(marked):
            entries, made = adjusted[m.task.pid]
            marked[i] = RelabelledTask(replace(m.task, entries=entries, image={**m.task.image,
                                                                                "entries": [m.task.head, *entries]}),
                                       replace(m.changed, made_eager=m.changed.made_eager + made))
    yield from marked


def view(images: Path, out: Path, pycriu: Any) -> Relabelled:
    """The dump in `images` with pitstop's lazy marks, for CRIU's own lazy restore from a local
    copy: every file hard-linked except the task pagemaps, rewritten (pages files unchanged,
    their order holds).  What changed, over all tasks."""
    out.mkdir(mode=0o700, exist_ok=True)
    total = Relabelled()
    rewritten: set[str] = set()
    for marked in task_images(images, pycriu):
        with open(out / marked.task.pagemap.name, "wb") as f:
            dump_pagemap(marked.task.image, f, pycriu)
        total.made_lazy += marked.changed.made_lazy
        total.made_eager += marked.changed.made_eager
        rewritten.add(marked.task.pagemap.name)
    link_the_rest(images, out, rewritten)
    return total

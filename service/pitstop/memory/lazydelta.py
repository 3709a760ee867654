"""A delta and its pre-copy, restored post-copy: the pages served to CRIU's daemon by pitstop.

A delta (precopy.py) marks the pages unchanged since the pre-copy PE_PARENT: CRIU's eager
restore reads them from the `parent` image.  CRIU's local lazy-pages daemon cannot: it reads a
parent page into its buffer and never places it (criu/pagemap.c, read_parent_page, calls the
parent page_read's read_pages, and only the top page_read has the io_complete callback that
criu/uffd.c sets to copy the page into the process), so the faulting thread waits forever.
Seen on CRIU 4.2 here as "pr1-2 Read from parent" and then nothing until the restorer gave up.

So for a lazy restore of a delta the destination writes a *view* that has no parent:
- every lazy page, changed (in the delta's pages file) or not (in the pre-copy's), becomes
  "lazy, not present", and the index (postcopy.TaskPages, two files) says where each lies;
- the few pages the restore places itself (not lazy: a thread's stack, say) are copied into
  the view's pages file, from the delta or from the pre-copy;
and the daemon asks for the lazy pages over CRIU's page-server protocol, which a local server
answers from the two files (memory/local_pages.py), exactly as a source does for network
post-copy.  Both files are on this host and verified before the source is released: after
the commit the worker depends on this host only.
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.criu import runtime
from pitstop.errors import RestoreFailed
from pitstop.memory import cowpages, lazyrule
from pitstop.memory.dumpview import (
    PAGE,
    PE_COW,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    dump_pagemap,
    link_the_rest,
    load_pagemap,
)
from pitstop.memory.postcopy import LazySplit, TaskPages, copy_range, split_present

INDEX = "lazy-pages-index.json"
DELTA, PARENT = 0, 1  # file indices in each task's TaskPages


@dataclass
class _ParentPages:
    """A pre-copy task's pages: sorted (vaddr, nr_pages, offset) of its present entries, in its
    pages file `file`; and the runs (vaddr, nr_pages) of its PE_COW entries, which are its parent
    task's pages (`up`: that task's, in the same pre-copy; precopy.py writes them for a forked
    child's shared pages)."""

    runs: list[tuple[int, int, int]]
    file: Path
    cow: list[tuple[int, int]] = field(default_factory=list)
    up: _ParentPages | None = None

    def pieces(self, vaddr: int, n: int) -> list[tuple[int, int, int, Path]]:
        """(vaddr, nr_pages, offset, pages file) covering [vaddr, vaddr + n pages), split where the
        pre-copy's entries end; raises if a page is missing (the delta then does not belong to it)."""
        out = []
        while n:
            i = bisect.bisect_right(self.runs, (vaddr, 1 << 63, 0)) - 1
            if i >= 0 and self.runs[i][0] <= vaddr < self.runs[i][0] + self.runs[i][1] * PAGE:
                start, k, off = self.runs[i]
                take = min(n, k - (vaddr - start) // PAGE)
                out.append((vaddr, take, off + (vaddr - start), self.file))
            else:
                j = bisect.bisect_right(self.cow, (vaddr, 1 << 63)) - 1
                if j < 0 or self.up is None or not self.cow[j][0] <= vaddr < self.cow[j][0] + self.cow[j][1] * PAGE:
                    raise RestoreFailed(f"the pre-copy has no page at {vaddr:#x}, which its delta says it has",
                                        action="the move rolls back; evacuate again (or with `--no-pre-copy`)")
                start, k = self.cow[j]
                take = min(n, k - (vaddr - start) // PAGE)
                out += self.up.pieces(vaddr, take)
            vaddr += take * PAGE
            n -= take
        return out


def _parent_pages(parent: Path, pid: int, pycriu: Any) -> _ParentPages:
    img = load_pagemap(parent / f"pagemap-{pid}.img", pycriu)
    runs, cow, off = [], [], 0
    for e in img["entries"][1:]:
        flags, va, n = int(e["flags"]), int(e["vaddr"]), int(e["nr_pages"])
        if flags & PE_PRESENT:
            runs.append((va, n, off))
            off += n * PAGE
        elif flags & PE_COW:
            cow.append((va, n))
    return _ParentPages(sorted(runs), parent / f"pages-{img['entries'][0]['pages_id']}.img", sorted(cow))


def _pre_copy_pages(parent: Path, pids: list[int], parents: dict[int, int], pycriu: Any) -> dict[int, _ParentPages]:
    """Each task's pages in the pre-copy, the PE_COW runs of each linked to its parent's."""
    out = {pid: _parent_pages(parent, pid, pycriu) for pid in pids if (parent / f"pagemap-{pid}.img").exists()}
    for pid, pp in out.items():
        pp.up = out.get(parents.get(pid, 0))
    return out


def view(delta: Path, parent: Path, out: Path, rt: runtime.CriuRuntime | None = None) -> LazySplit:
    """Write the parentless lazy view of `delta` (whose parent is `parent`) into `out`, and its
    index (INDEX, for the page server) beside the images."""
    pycriu = (rt or runtime.locate()).import_pycriu()
    out.mkdir(mode=0o700, exist_ok=True)
    split = LazySplit(tasks={})
    rewritten: set[str] = set()
    # pitstop's lazy marks, not CRIU's (lazyrule.py): CRIU's incremental dump marks no page of
    # the parent lazy, and its marks of the others have CRIU's stack bug
    tasks = [m.task for m in lazyrule.task_images(delta, pycriu)]
    pre = _pre_copy_pages(parent, [t.pid for t in tasks], cowpages.parents_of(delta, pycriu), pycriu)
    for t in tasks:
        pp = pre.get(t.pid)
        if pp is None:
            raise RestoreFailed(f"the pre-copy has no pagemap of task {t.pid}, which its delta has",
                                action="the move rolls back; evacuate again (or with `--no-pre-copy`)")
        # the delta's file, the task's own pre-copy file, and those of the tasks its shared pages name
        task = TaskPages(files=[delta / t.pages_name, pp.file])
        src = os.open(delta / t.pages_name, os.O_RDONLY)
        fds: dict[Path, int] = {}
        dst = os.open(out / t.pages_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

        def index(f: Path) -> int:
            if f not in task.files:
                task.files.append(f)
            return task.files.index(f)

        try:
            off = 0
            for e in t.entries:
                flags, va, n = int(e["flags"]), int(e["vaddr"]), int(e["nr_pages"])
                if flags & PE_PARENT:
                    if flags & PE_LAZY:
                        task.entries += [(v, k, o, index(f)) for v, k, o, f in pp.pieces(va, n)]
                        split.lazy_bytes += n * PAGE
                        e["flags"] = PE_LAZY
                    else:  # placed by the restore itself: into the view's own pages
                        for _v, k, o, f in pp.pieces(va, n):
                            if f not in fds:
                                fds[f] = os.open(f, os.O_RDONLY)
                            copy_range(fds[f], dst, o, k * PAGE)
                        split.eager_bytes += n * PAGE
                        e["flags"] = PE_PRESENT
                elif flags & PE_PRESENT:  # changed since the pre-copy: in the delta, as postcopy splits it
                    off = split_present(e, off, src, dst, task, split, DELTA)
            if off != os.fstat(src).st_size:
                raise RestoreFailed(f"{t.pagemap.name} describes {off} bytes of pages, {t.pages_name} holds "
                                    f"{os.fstat(src).st_size}", action="the move rolls back; report it")
        finally:
            for fd in (src, dst, *fds.values()):
                os.close(fd)
        with open(out / t.pagemap.name, "wb") as pm:
            dump_pagemap(t.image, pm, pycriu)
        task.entries.sort()
        split.tasks[t.pid] = task
        rewritten |= {t.pagemap.name, t.pages_name}
    link_the_rest(delta, out, rewritten)
    write_index(out / INDEX, split)
    return split


def write_index(path: Path, split: LazySplit) -> None:
    path.write_text(json.dumps({str(pid): t.to_json() for pid, t in split.tasks.items()}))


def read_index(path: Path) -> LazySplit:
    return LazySplit(tasks={int(pid): TaskPages.from_json(t) for pid, t in json.loads(path.read_text()).items()})

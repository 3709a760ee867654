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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pitstop.criu import runtime
from pitstop.errors import RestoreFailed
from pitstop.memory import lazyrule
from pitstop.memory.dumpview import PAGE, PE_LAZY, PE_PARENT, PE_PRESENT, dump_pagemap, link_the_rest, load_pagemap
from pitstop.memory.postcopy import LazySplit, TaskPages, copy_range, split_present

INDEX = "lazy-pages-index.json"
DELTA, PARENT = 0, 1  # file indices in each task's TaskPages


@dataclass
class _ParentPages:
    """A pre-copy task's pages: sorted (vaddr, nr_pages, offset) of its present entries."""

    runs: list[tuple[int, int, int]]

    def pieces(self, vaddr: int, n: int) -> list[tuple[int, int, int]]:
        """(vaddr, nr_pages, offset) covering [vaddr, vaddr + n pages), split where the pre-copy's
        entries end; raises if a page is missing (the delta then does not belong to it)."""
        out = []
        while n:
            i = bisect.bisect_right(self.runs, (vaddr, 1 << 63, 0)) - 1
            if i < 0 or not self.runs[i][0] <= vaddr < self.runs[i][0] + self.runs[i][1] * PAGE:
                raise RestoreFailed(f"the pre-copy has no page at {vaddr:#x}, which its delta says it has",
                                    action="the move rolls back; evacuate again (or with `--no-pre-copy`)")
            start, k, off = self.runs[i]
            take = min(n, k - (vaddr - start) // PAGE)
            out.append((vaddr, take, off + (vaddr - start)))
            vaddr += take * PAGE
            n -= take
        return out


def _parent_pages(parent: Path, pid: int, pycriu: Any) -> tuple[_ParentPages, Path]:
    img = load_pagemap(parent / f"pagemap-{pid}.img", pycriu)
    runs, off = [], 0
    for e in img["entries"][1:]:
        if int(e["flags"]) & PE_PRESENT:
            runs.append((int(e["vaddr"]), int(e["nr_pages"]), off))
            off += int(e["nr_pages"]) * PAGE
    return _ParentPages(sorted(runs)), parent / f"pages-{img['entries'][0]['pages_id']}.img"


def view(delta: Path, parent: Path, out: Path, rt: runtime.CriuRuntime | None = None) -> LazySplit:
    """Write the parentless lazy view of `delta` (whose parent is `parent`) into `out`, and its
    index (INDEX, for the page server) beside the images."""
    pycriu = (rt or runtime.locate()).import_pycriu()
    out.mkdir(mode=0o700, exist_ok=True)
    split = LazySplit(tasks={})
    rewritten: set[str] = set()
    # pitstop's lazy marks, not CRIU's (lazyrule.py): CRIU's incremental dump marks no page of
    # the parent lazy, and its marks of the others have CRIU's stack bug
    for t in (m.task for m in lazyrule.task_images(delta, pycriu)):
        pp, parent_file = _parent_pages(parent, t.pid, pycriu)
        task = TaskPages(files=[delta / t.pages_name, parent_file])
        src = os.open(delta / t.pages_name, os.O_RDONLY)
        psrc = os.open(parent_file, os.O_RDONLY)
        dst = os.open(out / t.pages_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            off = 0
            for e in t.entries:
                flags, va, n = int(e["flags"]), int(e["vaddr"]), int(e["nr_pages"])
                if flags & PE_PARENT:
                    if flags & PE_LAZY:
                        task.entries += [(v, k, o, PARENT) for v, k, o in pp.pieces(va, n)]
                        split.lazy_bytes += n * PAGE
                        e["flags"] = PE_LAZY
                    else:  # placed by the restore itself: into the view's own pages
                        for _v, k, o in pp.pieces(va, n):
                            copy_range(psrc, dst, o, k * PAGE)
                        split.eager_bytes += n * PAGE
                        e["flags"] = PE_PRESENT
                elif flags & PE_PRESENT:  # changed since the pre-copy: in the delta, as postcopy splits it
                    off = split_present(e, off, src, dst, task, split, DELTA)
            if off != os.fstat(src).st_size:
                raise RestoreFailed(f"{t.pagemap.name} describes {off} bytes of pages, {t.pages_name} holds "
                                    f"{os.fstat(src).st_size}", action="the move rolls back; report it")
        finally:
            for fd in (src, psrc, dst):
                os.close(fd)
        with open(out / t.pagemap.name, "wb") as f:
            dump_pagemap(t.image, f, pycriu)
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

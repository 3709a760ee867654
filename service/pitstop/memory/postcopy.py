"""Post-copy over the network: split a dump into what the restore needs and what may follow it.

CRIU's own network post-copy (`dump --lazy-pages`) fails on this kernel: its page server keeps
the pages in pipes and tee(2)s them ("page-pipe: tee: Operation not permitted").  The dump
pitstop already makes works as the source instead: a plain dump's pagemap already says which
pages a lazy restore may leave out (PE_LAZY), and pitstop corrects CRIU's marks where its
stack test fails them (lazyrule.py).  So the source agent

- writes a *view* of the dump: every image file as it is, except that each task's pagemap has
  its lazy entries turned into "lazy, not present" and its pages file keeps only the pages the
  restore itself must place (file-backed private memory, stacks, vDSO): what CRIU's
  `dump --lazy-pages` would have written.  The view is what travels before the restore;
- serves the lazy pages from the full, local dump to the destination's `criu lazy-pages`
  daemon on request (memory/page_server.py), after the job has resumed.

The full dump stays on the source until the fill has ended: a rollback still restores from it.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.criu import runtime
from pitstop.errors import CaptureFailed
from pitstop.memory import lazyrule
from pitstop.memory.dumpview import PAGE, PE_LAZY, PE_PRESENT, dump_pagemap, link_the_rest


@dataclass
class TaskPages:
    """Where a task's lazy pages lie: sorted (vaddr, nr_pages, offset, file index) over `files`.

    One file where the source serves from its full dump; two where a destination serves a
    delta and its pre-copy (lazydelta.py)."""

    files: list[Path]
    entries: list[tuple[int, int, int, int]] = field(default_factory=list)

    def locate(self, vaddr: int, nr_pages: int) -> tuple[int, int, int] | None:
        """(file index, file offset, pages available from vaddr, at most nr_pages), or None if
        the page is not lazy here."""
        i = bisect.bisect_right(self.entries, (vaddr, 1 << 63, 0, 0)) - 1
        if i < 0:
            return None
        start, n, off, fi = self.entries[i]
        if not start <= vaddr < start + n * PAGE or vaddr % PAGE:
            return None
        return fi, off + (vaddr - start), min(nr_pages, (start + n * PAGE - vaddr) // PAGE)

    def to_json(self) -> dict[str, Any]:
        return {"files": [str(f) for f in self.files], "entries": self.entries}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "TaskPages":
        return cls(files=[Path(f) for f in d["files"]], entries=sorted(tuple(e) for e in d["entries"]))


@dataclass
class LazySplit:
    """tasks: where each task's lazy pages lie.  made_lazy_bytes, made_eager_bytes: what
    pitstop's marks changed against CRIU's (lazyrule.py); a dump whose lazy bytes were all
    made lazy is one CRIU would have sent whole."""

    tasks: dict[int, TaskPages]
    eager_bytes: int = 0
    lazy_bytes: int = 0
    made_lazy_bytes: int = 0
    made_eager_bytes: int = 0


def split(images: Path, view: Path, rt: runtime.CriuRuntime | None = None) -> LazySplit:
    """Write the view of the dump in `images` into `view` (hard links where nothing changes)."""
    pycriu = (rt or runtime.locate()).import_pycriu()
    view.mkdir(mode=0o700, exist_ok=True)
    rewritten: set[str] = set()
    out = LazySplit(tasks={})
    for marked in lazyrule.task_images(images, pycriu):
        t = marked.task
        out.made_lazy_bytes += marked.changed.made_lazy * PAGE
        out.made_eager_bytes += marked.changed.made_eager * PAGE
        pm, img, entries, pages_name = t.pagemap, t.image, t.entries, t.pages_name
        task = TaskPages(files=[images / pages_name])
        src = os.open(images / pages_name, os.O_RDONLY)
        dst = os.open(view / pages_name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            off = 0
            for e in entries:
                # CRIU's own entries (up to 1 MiB).  Merging contiguous ones, so that the daemon asks
                # in 4 MiB requests, was not faster: a 1.08 GB fill took 1.32-1.34 s merged, 0.76-1.28 s
                # not (2026-11-29, 2 runs against 5)
                if int(e["flags"]) & PE_PRESENT:
                    off = split_present(e, off, src, dst, task, out, 0)
            if off != os.fstat(src).st_size:
                raise CaptureFailed(f"{pm.name} describes {off} bytes of pages, {pages_name} holds "
                                    f"{os.fstat(src).st_size}", action="report it: the dump is inconsistent")
        finally:
            os.close(src)
            os.close(dst)
        with open(view / pm.name, "wb") as f:
            dump_pagemap(img, f, pycriu)
        task.entries.sort()
        out.tasks[t.pid] = task
        rewritten |= {pm.name, pages_name}
    link_the_rest(images, view, rewritten)
    return out


def split_present(e: dict[str, Any], off: int, src: int, dst: int, task: TaskPages, out: LazySplit,
                  file_index: int) -> int:
    """One present pagemap entry, at `off` in the pages file `src`: a lazy one is indexed (file
    `file_index` of `task`) and marked not present, an eager one copied into the view's `dst`.
    The offset of the next entry's pages."""
    flags, n = int(e["flags"]), int(e["nr_pages"])
    if flags & PE_LAZY:
        e["flags"] = flags & ~PE_PRESENT
        task.entries.append((int(e["vaddr"]), n, off, file_index))
        out.lazy_bytes += n * PAGE
    else:
        copy_range(src, dst, off, n * PAGE)
        out.eager_bytes += n * PAGE
    return off + n * PAGE


def copy_range(src: int, dst: int, off: int, n: int) -> None:
    while n:
        k = os.copy_file_range(src, dst, n, off)
        if k == 0:
            raise CaptureFailed("a pages file ended early while splitting a dump", action="report it")
        off += k
        n -= k


def describe(s: LazySplit) -> dict[str, Any]:
    return {"eager_bytes": s.eager_bytes, "lazy_bytes": s.lazy_bytes, "tasks": len(s.tasks),
            "made_lazy_bytes": s.made_lazy_bytes, "made_eager_bytes": s.made_eager_bytes}

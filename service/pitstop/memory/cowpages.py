"""Pages a child shares with its parent (PE_COW), in the lazy views pitstop writes of a dump.

The CRIU pitstop carries (criu/patches/) writes a page a forked child still shares
copy-on-write with its parent as a PE_COW entry: no bytes in the child's image, "the parent
task's page at this address".  An eager restore keeps such pages shared (the child is forked
from its restored parent).  In a lazy restore, CRIU reads them where the parent's page is:
a page the restore places itself (eager) through the parent's pagemap in the images here, a lazy
one from the daemon's source, which for a page server means asking it for the parent task's page
(criu/patches/0001).  A page server holds a task's lazy pages only, and the view holds its eager
ones only: so a PE_COW page must be lazy exactly where the parent's page is.  In every lazy view
pitstop makes (lazyrule.task_images is their common source), after each task's own rule:

1. children first: a PE_COW page that must be eager (its thread's stack, lazyrule) makes the
   parent's page eager too, and so on up (the parent's may be PE_COW as well);
2. parents first: a PE_COW page is lazy only where the parent's page is (now) lazy.

This also answers which CRIU can restore an image: one that has PE_COW entries needs the carried
CRIU (`needs_carried_criu`); a stock CRIU would read a PE_COW entry's pages from the child's own
pages file, where they are not.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from pitstop.memory.dumpview import PAGE, PE_COW, PE_LAZY, PE_PARENT, PE_PRESENT, task_images

Span = tuple[int, int]  # [start, end) addresses


def parents_of(images: Path, pycriu: Any) -> dict[int, int]:
    """Each task's parent in the dump (pid -> ppid; the root's is 0), from its pstree image."""
    with open(images / "pstree.img", "rb") as f:
        tree = pycriu.images.load(f, pretty=False)["entries"]
    return {int(t["pid"]): int(t.get("ppid") or 0) for t in tree}


def needs_carried_criu(images: Path, pycriu: Any) -> list[int]:
    """The tasks of the dump in `images` whose pagemaps have PE_COW entries (empty: any CRIU can
    restore it)."""
    return [t.pid for t in task_images(images, pycriu) if any(int(e["flags"]) & PE_COW for e in t.entries)]


def merge(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def make_eager(entries: list[dict[str, Any]], spans: list[Span]) -> tuple[list[dict[str, Any]], int]:
    """`entries` with PE_LAZY cleared where they overlap `spans` (sorted, disjoint), each cut at
    the spans' edges, and how many pages became eager.  Entries without pages anywhere (neither
    present, in a parent image nor the parent task's) pass as they are."""
    return _cut_lazy(entries, spans, eager_inside=True)


def lazy_within(entries: list[dict[str, Any]], spans: list[Span]) -> tuple[list[dict[str, Any]], int]:
    """`entries` with PE_LAZY cleared on PE_COW pages outside `spans` (where the parent's pages
    are lazy); how many became eager."""
    return _cut_lazy(entries, spans, eager_inside=False, only=PE_COW)


def _cut_lazy(entries: list[dict[str, Any]], spans: list[Span], eager_inside: bool,
              only: int = PE_PRESENT | PE_PARENT | PE_COW) -> tuple[list[dict[str, Any]], int]:
    starts = [a for a, _ in spans]
    out: list[dict[str, Any]] = []
    made = 0
    for e in entries:
        flags, va, n = int(e["flags"]), int(e["vaddr"]), int(e["nr_pages"])
        end = va + n * PAGE
        if not flags & only or not flags & PE_LAZY:
            out.append(e)
            continue
        cur = va
        i = max(bisect.bisect_right(starts, va) - 1, 0)
        while cur < end:
            while i < len(spans) and spans[i][1] <= cur:
                i += 1
            inside = i < len(spans) and spans[i][0] <= cur
            stop = min(end, spans[i][1]) if inside else (min(end, spans[i][0]) if i < len(spans) else end)
            k = (stop - cur) // PAGE
            eager = inside == eager_inside
            out.append({**e, "vaddr": cur, "nr_pages": k, "flags": flags & ~PE_LAZY if eager else flags})
            made += k if eager else 0
            cur = stop
    return out, made


def _spans(entries: list[dict[str, Any]], flags: int, lazy: bool) -> list[Span]:
    """Where entries with all of `flags` lie, lazy or not as asked."""
    return merge([(int(e["vaddr"]), int(e["vaddr"]) + int(e["nr_pages"]) * PAGE) for e in entries
                  if int(e["flags"]) & flags == flags and bool(int(e["flags"]) & PE_LAZY) == lazy])


def like_parents(tasks: dict[int, list[dict[str, Any]]],
                 parents: dict[int, int]) -> dict[int, tuple[list[dict[str, Any]], int]]:
    """Every task's entries (pid -> entries) with its PE_COW pages lazy exactly where the parent's
    pages are (the module's two steps).  Returns, per task, its new entries and how many of its
    pages became eager."""
    def depth(pid: int) -> int:
        d = 0
        while parents.get(pid, 0) in tasks and d < len(tasks):
            pid, d = parents[pid], d + 1
        return d

    for pid in tasks:
        if _spans(tasks[pid], PE_COW, lazy=False) or _spans(tasks[pid], PE_COW, lazy=True):
            if parents.get(pid, 0) not in tasks:
                raise ValueError(f"task {pid} names pages of its parent {parents.get(pid, 0)}, "
                                 "which the dump does not hold")
    order = sorted(tasks, key=depth)
    entries = dict(tasks)
    made = dict.fromkeys(tasks, 0)
    need: dict[int, list[Span]] = {}
    for pid in reversed(order):  # 1. children first: an eager shared page makes the parent's eager
        entries[pid], k = make_eager(entries[pid], merge(need.get(pid, [])))
        made[pid] += k
        eager = _spans(entries[pid], PE_COW, lazy=False)
        if eager:
            need.setdefault(parents[pid], []).extend(eager)
    for pid in order:  # 2. parents first: a shared page is lazy only where the parent's is
        if parents.get(pid, 0) in tasks and _spans(entries[pid], PE_COW, lazy=True):
            lazy = merge(_spans(entries[parents[pid]], PE_PRESENT, lazy=True)
                         + _spans(entries[parents[pid]], PE_PARENT, lazy=True)
                         + _spans(entries[parents[pid]], PE_COW, lazy=True))
            entries[pid], k = lazy_within(entries[pid], lazy)
            made[pid] += k
    return {pid: (entries[pid], made[pid]) for pid in tasks}

"""Pre-copy: send a running worker's memory ahead, then only what changed once it is paused.

The classic way to shorten a stop-and-copy is CRIU's iterative pre-dump, which asks the
kernel which pages were written since the last pass (soft-dirty bits).  This kernel has no
soft-dirty (CONFIG_MEM_SOFT_DIRTY is off), so pitstop compares contents instead:

1. *Before anything pauses* (`snapshot`), the source agent reads every private anonymous page
   of the running tree through /proc/<pid>/mem and writes it as a CRIU image set of its own:
   `pagemap-<pid>.img` (every entry "present") and `pages-<pid>.img`.  That set travels to the
   destination, where it becomes the parent image directory of the real dump.  The agent keeps
   only digests of what it sent: xxh3-128 per aligned 64 KiB block, per page at a run's edges.
   A page read while the worker writes it may be torn; that is fine, the digest is of the bytes
   that were sent, and a torn page differs from the final one.
2. *After the pause* (`rewrite`), CRIU dumps the stopped tree as always (the source keeps that
   full dump: a rollback restores from it).  The agent digests each page of the dump at the
   same addresses and writes a *delta view*: every image file as it is, except that each
   task's pagemap marks the unchanged runs PE_PARENT (CRIU's own "this page is in the parent
   image", as a pre-dump chain writes it) and its pages file keeps only the changed pages.
3. The destination links the pre-copy as `parent` in the delta's directory, and CRIU's restore
   reads the PE_PARENT runs from there (criu/pagemap.c, read_parent_page).  CRIU's lazy-pages
   daemon cannot read a parent, so a lazy restore of a delta goes through a parentless view
   and a local page server instead (lazydelta.py).

A forked child (a DataLoader worker) maps most of its parent's memory copy-on-write.  Where the
CRIU that runs here is the one pitstop carries (criu/patches/), the pre-copy writes a child's page
that is the same physical page as its parent's at the same address as a PE_COW entry ("the
parent's page"), as that CRIU's dump does, instead of reading it again: a rank with N workers
pre-copies about its own memory, not N + 1 copies of it.  The comparison of frame numbers comes
after the parent's page was read: a write by either since breaks the sharing, so a page still
shared then is the bytes the parent's image holds.  Such a page has no digest: if it is no longer
shared at the pause, the dump has it and it travels.

Where the kernel and the worker allow it (memory/writetrack.py), step 2 asks the kernel instead
of hashing: the tree's memory is write-protected (async userfaultfd) before a page is read, and
at the pause PAGEMAP_SCAN lists what was written since.  A page is then unchanged when it was
pre-copied and not written; nothing is hashed or mapped during the pause, and only the changed
pages are copied.  A process that cannot be tracked is hashed as before.

A digest match is the only evidence that a page is unchanged, so the digest is 128 bits:
a collision between a page's old and new contents (about 2^-128 per page) is the one way a
wrong page could be restored.  A tenant can only forge one against its own memory.
"""

from __future__ import annotations

import bisect
import mmap
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from pitstop import nsinit
from pitstop.criu import runtime
from pitstop.errors import CaptureFailed
from pitstop.memory import lazyrule, writetrack
from pitstop.memory.dumpview import PAGE, PE_COW, PE_LAZY, PE_PARENT, PE_PRESENT, dump_pagemap, link_the_rest
from pitstop.proc import proctree

BLOCK_PAGES = 16
BLOCK = PAGE * BLOCK_PAGES
READ_CHUNK = 4 << 20
GROUP_BYTES = 64 << 20
PAGEMAP_CHUNK = 1 << 16  # pagemap entries read at a time (512 KiB)
# A swapped entry's frame field is its swap type (low 5 bits, MAX_SWAPFILES_SHIFT) and offset;
# the kernel shows it to CAP_SYS_ADMIN only (an agent without it sees 0: every entry a page, the
# old, slower but correct reading).  The last type is the PTE marker's (include/linux/swap.h).
_PFN_MASK = (1 << 55) - 1  # a present entry's frame number (0 where the kernel hides it)
_SWAP_TYPE_MASK = (1 << 5) - 1
_SWP_PTE_MARKER = _SWAP_TYPE_MASK
PRE_SUFFIX = "-pre"  # a pre-copy's image id at the destination: its move's image id plus this
CRIU_IMAGES_V1_1 = 2  # criu/include/image.h: the image version an inventory says it is
# Mappings of the kernel's that CRIU's dump takes whole (criu/mem.c, should_dump_entire_vma),
# so an incremental dump marks their pages "in the parent" unless they are soft-dirty: the
# pre-copy carries them, without digests or tracking (their contents never change).
WHOLE_VMAS = ("[vdso]",)
_digest = xxhash.xxh3_128_intdigest


@dataclass
class TaskDigests:
    """What the destination holds of one process: digests by address."""

    blocks: dict[int, int] = field(default_factory=dict)  # aligned 64 KiB block -> digest
    pages: dict[int, int] = field(default_factory=dict)  # page outside a whole block -> digest
    # Tracked instead of digested (writetrack.py): what was pre-copied, as (start, end), in order;
    # at the pause, what of that was not written since (`unchanged`).
    tracker: writetrack.Tracked | None = None
    copied: list[tuple[int, int]] = field(default_factory=list)
    unchanged: list[tuple[int, int]] | None = None


@dataclass
class Basis:
    """What a pre-copy sent, by the process ids the dump will use (the worker's own namespace)."""

    worker_id: str
    tasks: dict[int, TaskDigests]
    bytes: int = 0
    seconds: float = 0.0
    untracked: dict[int, str] = field(default_factory=dict)  # pid here -> why its writes were not tracked
    # pitstop's namespace init (nsinit.py): a few pages, not tracked; dumped whole each time
    # (criutrack.c reports untracked memory as written), by its namespace's pid
    exempt: set[int] = field(default_factory=set)
    # The pre-copy's images, kept here where CRIU's incremental dump will use them as its parent
    # (criutrack.py); the capture moves them into its own image directory.
    local: Path | None = None

    def close(self) -> None:
        """End the write tracking (this agent's userfaultfds of the tree)."""
        for t in self.tasks.values():
            if t.tracker is not None:
                t.tracker.close()
                t.tracker = None

    def discard(self) -> None:
        """A pre-copy no move will use: end its tracking and delete what was kept of it here."""
        self.close()
        self.drop_local()

    def drop_local(self) -> None:
        """Delete the copy kept here for CRIU's incremental dump (its parent): none will use it."""
        if self.local is not None:
            shutil.rmtree(self.local, ignore_errors=True)
            self.local = None

    def distrust(self, host_pids: set[int], why: str) -> int:
        """Drop the write tracking of these processes (pids on this host): their delta is cut by
        the digests taken with the pre-copy instead.  For a process that began to use a GPU after
        its tracking started: the device can write host memory it has pinned without the page
        tables seeing it, while a digest sees any change.  Returns how many were tracked."""
        n = 0
        for t in self.tasks.values():
            if t.tracker is not None and t.tracker.pid in host_pids:
                self.untracked[t.tracker.pid] = why
                t.tracker.close()
                t.tracker, t.copied = None, []
                n += 1
        return n

    def fully_tracked(self) -> bool:
        """Every process's writes tracked: what CRIU's incremental dump needs (an untracked one
        would be dumped whole by it, and not be cut by digests either)."""
        return bool(self.tasks) and not self.untracked and all(
            t.tracker is not None or vpid in self.exempt for vpid, t in self.tasks.items())


@dataclass
class Delta:
    parent_bytes: int = 0  # left in the parent: not sent again
    changed_bytes: int = 0  # pages that changed or were not pre-copied: in the delta's pages files
    seconds: float = 0.0
    tracked_tasks: int = 0  # processes whose writes the kernel reported (the rest were hashed)
    digested_tasks: int = 0


# -- before the pause ------------------------------------------------------------------------------
def ns_pid(pid: int) -> int:
    """The id CRIU names the process's images by: its pid in the innermost pid namespace."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return pid


def anon_bytes(pids: list[int]) -> int:
    """About what a pre-copy of these processes writes (their resident anonymous memory)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith(("RssAnon:", "VmSwap:")):
                        total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def _anon_runs(pagemap_fd: int, start: int, end: int) -> list[tuple[int, int]]:
    """Runs (vaddr, pages) of anonymous pages in memory or swap: what CRIU dumps of a private VMA."""
    runs: list[tuple[int, int]] = []
    first = start // PAGE
    total = (end - start) // PAGE
    done = 0
    while done < total:
        n = min(PAGEMAP_CHUNK, total - done)
        raw = os.pread(pagemap_fd, n * 8, (first + done) * 8)
        if len(raw) < n * 8:
            n = len(raw) // 8
            if n == 0:
                break
        e = np.frombuffer(raw, dtype=np.uint64, count=n)
        present = ((e >> np.uint64(63)) & np.uint64(1)).astype(bool)
        swapped = ((e >> np.uint64(62)) & np.uint64(1)).astype(bool)
        # A swap entry of type SWP_PTE_MARKER holds no page: it is a mark a userfaultfd's write
        # protection leaves on memory protected before it was touched, or a guard region.  Read
        # as a page it is zeros (writetrack.py protects only pages that exist, so it makes none).
        marker = swapped & ~present & ((e & np.uint64(_SWAP_TYPE_MASK)) == np.uint64(_SWP_PTE_MARKER))
        keep = (present | swapped) & ~marker
        keep &= ~((e >> np.uint64(61)) & np.uint64(1)).astype(bool)  # a page of the file: not dumped
        if keep.any():
            edges = np.flatnonzero(np.diff(np.concatenate(([0], keep.view(np.int8), [0]))))
            for a, b in zip(edges[::2], edges[1::2]):
                va = start + (done + int(a)) * PAGE
                if runs and runs[-1][0] + runs[-1][1] * PAGE == va:
                    runs[-1] = (runs[-1][0], runs[-1][1] + int(b - a))
                else:
                    runs.append((va, int(b - a)))
        done += n
    return runs


def _digest_run(d: TaskDigests, vaddr: int, data: memoryview) -> None:
    """Digests of one contiguous run: whole aligned blocks as blocks, the edges page by page."""
    end = vaddr + len(data)
    p = vaddr
    while p < end:
        if p % BLOCK == 0 and p + BLOCK <= end:
            d.blocks[p] = _digest(data[p - vaddr:p - vaddr + BLOCK])
            p += BLOCK
        else:
            d.pages[p] = _digest(data[p - vaddr:p - vaddr + PAGE])
            p += PAGE


def snapshot(worker_id: str, pids: list[int], out: Path, rt: runtime.CriuRuntime | None = None,
             stop: threading.Event | None = None, track: bool = False) -> Basis:
    """Write the running tree's anonymous memory into `out` as a parent image set; return its digests.

    Pages files are written before their pagemaps, so a reader tailing `out` sees the pagemap
    only once its pages are complete.  `stop` (set by whoever gave up on this pre-copy) ends
    it within one read of 4 MiB: a pre-copy nobody waits for must not go on using the CPU and
    the network the move that follows needs.  With `track`, the tree's writes are tracked from
    before its first page is read (writetrack.py) where they can be; the caller owns the
    result's tracking and ends it with `Basis.close()` (rewrite() does)."""
    pycriu = (rt or runtime.locate()).import_pycriu()
    t0 = time.monotonic()
    basis = Basis(worker_id=worker_id, tasks={})
    stop = stop or threading.Event()
    # CRIU's incremental dump takes a parent for a process only if the process started before
    # it (pid reuse, criu/mem.c detect_pid_reuse): the time its pages began to be read
    uptime_us = time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1000
    inits = {p for p in pids if nsinit.is_init(p)}
    trackers, basis.untracked = writetrack.start([p for p in pids if p not in inits]) if track else ({}, {})
    # what each process's image holds, by host pid: a child's shared pages may name its parent's
    held: dict[int, list[tuple[int, int]]] | None = {} if (rt or runtime.locate()).carried else None
    try:
        for pid in pids:
            tr = trackers.pop(pid, None)
            try:
                vpid, digests, n = _snapshot_one(pycriu, pid, out, stop, tr, held)
            except _Stopped:
                raise stopped_error(worker_id) from None
            except OSError as e:  # it ended, or its memory went away, while being read (a partial
                # pages file without its pagemap may be left: CRIU reads pages only through a pagemap)
                if tr is not None:
                    tr.close()
                if pid == pids[0]:
                    raise CaptureFailed(f"the pre-copy of worker {worker_id} could not read its memory "
                                        f"(pid {pid}): {e}", code="worker_gone",
                                        action="the move goes on without a pre-copy") from None
                continue  # a child that exited (a DataLoader worker between epochs): its pages go at the pause
            except BaseException:
                if tr is not None:
                    tr.close()
                raise
            basis.tasks[vpid] = digests
            basis.bytes += n * PAGE
            if pid in inits:
                basis.exempt.add(vpid)
    except BaseException:
        basis.close()
        raise
    finally:
        for tr in trackers.values():  # of processes that were not read
            tr.close()
    with open(out / "inventory.img", "wb") as f:
        pycriu.images.dump({"magic": "INVENTORY", "entries": [
            {"img_version": CRIU_IMAGES_V1_1, "fdinfo_per_id": True, "ns_per_id": True, "dump_uptime": uptime_us}]}, f)
    basis.seconds = time.monotonic() - t0
    return basis


class _Stopped(Exception):
    """The pre-copy's `stop` was set."""


def stopped_error(worker_id: str) -> CaptureFailed:
    """What a pre-copy stopped by its caller (DELETE /v1/precopies/{id}) answers."""
    return CaptureFailed(f"the pre-copy of worker {worker_id} was stopped: its caller gave up on it",
                         code="aborted", http_status=409, action="none: the move goes on without it")


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _shared_with(pm: int, ppm: int, held: list[tuple[int, int]], va: int, n: int) -> np.ndarray:
    """Which of n pages from va are the parent's physical page at the same address (and in the
    parent's image): frame numbers read now, after the parent's pages were."""
    mine = np.frombuffer(os.pread(pm, n * 8, va // PAGE * 8), dtype=np.uint64)
    theirs = np.frombuffer(os.pread(ppm, n * 8, va // PAGE * 8), dtype=np.uint64)
    k = min(len(mine), len(theirs))
    out = np.zeros(n, dtype=bool)
    present = np.uint64(1 << 63)
    both = (mine[:k] & present).astype(bool) & (theirs[:k] & present).astype(bool)
    frame = mine[:k] & np.uint64(_PFN_MASK)
    out[:k] = both & (frame != 0) & (frame == (theirs[:k] & np.uint64(_PFN_MASK)))
    if out.any():  # only where the parent's image has the page
        inside = np.zeros(n, dtype=bool)
        for a, m in held:
            lo, hi = max(a, va), min(a + m * PAGE, va + n * PAGE)
            if lo < hi:
                inside[(lo - va) // PAGE:(hi - va) // PAGE] = True
        out &= inside
    return out


def _cuts(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """mask cut into runs (first, count, value)."""
    edges = np.flatnonzero(np.diff(mask.view(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(mask)]
    return [(a, b - a, bool(mask[a])) for a, b in zip(bounds, bounds[1:]) if b > a]


def _snapshot_one(pycriu: Any, pid: int, out: Path, stop: threading.Event,
                  tracker: writetrack.Tracked | None = None,
                  held: dict[int, list[tuple[int, int]]] | None = None) -> tuple[int, TaskDigests, int]:
    """One process's anonymous memory into pages-<vpid>.img and pagemap-<vpid>.img: (vpid, digests, pages).
    held: what each process read before holds, by host pid (None: no PE_COW entries: a stock
    CRIU could not read them); this one's is added."""
    vpid = ns_pid(pid)
    ppid = _parent_of(pid) if held is not None else 0
    parent_held = held.get(ppid) if held is not None else None
    mine: list[tuple[int, int]] = []
    vmas = [(a, b, False) for a, b in proctree.private_vmas(pid)]
    vmas = sorted(vmas + [(a, b, True) for a, b in proctree.named_vmas(pid, WHOLE_VMAS)])
    digests = TaskDigests(tracker=tracker)
    entries: list[dict[str, Any]] = [{"pages_id": vpid}]
    pages = 0
    buf = bytearray(READ_CHUNK)  # reused: fresh memory for every read costs more than the copy here
    pm = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    ppm = -1
    try:
        if parent_held:
            try:
                ppm = os.open(f"/proc/{ppid}/pagemap", os.O_RDONLY)
            except OSError:  # the parent is gone: nothing is shared with it
                parent_held = None
        mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        try:
            with open(out / f"pages-{vpid}.img", "wb", buffering=0) as pf:
                for start, end, whole in vmas:
                    for va0, n0 in [(start, (end - start) // PAGE)] if whole else _anon_runs(pm, start, end):
                        parts = [(va0, n0, False)]
                        if parent_held and not whole:
                            parts = [(va0 + a * PAGE, k, s)
                                     for a, k, s in _cuts(_shared_with(pm, ppm, parent_held, va0, n0))]
                        for va, n, shared in parts:
                            if shared:  # the parent's page: no bytes here, nor a digest
                                entries.append({"vaddr": va, "compat_nr_pages": 0, "nr_pages": n, "flags": PE_COW})
                                mine.append((va, n))
                                if tracker:
                                    digests.copied.append((va, va + n * PAGE))
                                continue
                            # digests even where the kernel tracks the writes: the fallback for a process
                            # that may be written behind the page tables later (Basis.distrust); they cost
                            # 5-10 % of the pre-copy's time (bench/delta_cost.py, docs/benchmarks.md)
                            got = _copy_run(mem, pf, None if whole else digests, va, n, buf, stop)
                            if got and tracker and not whole:
                                digests.copied.append((va, va + got * PAGE))
                            if got:
                                entries.append({"vaddr": va, "compat_nr_pages": 0, "nr_pages": got,
                                                "flags": PE_PRESENT})
                                mine.append((va, got))
                                pages += got
        finally:
            os.close(mem)
    finally:
        os.close(pm)
        if ppm >= 0:
            os.close(ppm)
    if held is not None:
        held[pid] = mine
    with open(out / f"pagemap-{vpid}.img", "wb") as f:
        dump_pagemap({"magic": "PAGEMAP", "entries": entries}, f, pycriu)
    return vpid, digests, pages


def _copy_run(mem: int, pf: Any, d: TaskDigests | None, vaddr: int, n: int, buf: bytearray, stop: threading.Event) -> int:
    """Copy n pages from vaddr into the pages file; the pages copied (a VMA may vanish mid-way)."""
    copied = 0
    whole = memoryview(buf)
    while copied < n:
        if stop.is_set():
            raise _Stopped()
        k = min(n - copied, len(buf) // PAGE)
        va = vaddr + copied * PAGE
        try:
            got = os.preadv(mem, [whole[:k * PAGE]], va)
        except OSError:  # unmapped since the pagemap was read: the run ends here
            break
        k = got // PAGE
        if k == 0:
            break
        view = whole[:k * PAGE]
        pf.write(view)
        if d is not None:
            _digest_run(d, va, view)
        copied += k
        if k * PAGE < got or got < PAGE:
            break
    return copied


# -- after the pause -------------------------------------------------------------------------------
def rewrite(images: Path, view: Path, basis: Basis, rt: runtime.CriuRuntime | None = None,
            end_tracking: bool = True) -> Delta:
    """Write the delta view of the dump in `images` into `view` (hard links where nothing changes).

    `end_tracking=False` leaves the write tracking to the caller's `basis.close()`: closing a
    userfaultfd of a live process walks its page tables to lift the protection (28 ms for a
    torch rank here), which costs nothing once the process has exited, as a moved source does."""
    pycriu = (rt or runtime.locate()).import_pycriu()
    t0 = time.monotonic()
    try:
        _read_writes(basis)  # the tree is stopped: nothing writes between its dump and this
    finally:
        if end_tracking:
            basis.close()
    view.mkdir(mode=0o700, exist_ok=True)
    out = Delta()
    rewritten: set[str] = set()
    for marked in lazyrule.task_images(images, pycriu):  # its PE_LAZY marks decide a lazy restore of the delta
        t = marked.task
        pm, img, head, entries, pages_name = t.pagemap, t.image, t.head, t.entries, t.pages_name
        digests = basis.tasks.get(t.pid)
        new_entries: list[dict[str, Any]] = []
        if digests is not None and digests.unchanged is not None:
            out.tracked_tasks += 1
            _rewrite_tracked(images / pages_name, view / pages_name, pm.name, entries, digests.unchanged,
                             new_entries, out)
            with open(view / pm.name, "wb") as f:
                dump_pagemap({**img, "entries": [head, *new_entries]}, f, pycriu)
            rewritten |= {pm.name, pages_name}
            continue
        if t.pid not in basis.exempt:  # pitstop's init is no process of the job's
            out.digested_tasks += 1
        with open(images / pages_name, "rb", buffering=0) as src, \
                open(view / pages_name, "wb", buffering=0) as dst, _mapped(src.fileno()) as pages:
            size = len(pages)
            off = 0
            for group in _groups(entries):
                if isinstance(group, dict):  # not in this pages file: as it was
                    new_entries.append(group)
                    continue
                va, n, flags = group
                if off + n * PAGE > size:
                    raise CaptureFailed(f"{pm.name} describes more pages than {pages_name} holds",
                                        action="report it: the dump is inconsistent")
                with pages[off:off + n * PAGE] as data:
                    off += n * PAGE
                    _write_runs(digests, va, flags, data, dst, new_entries, out)
            if off != size:
                raise CaptureFailed(f"{pm.name} describes {off} bytes of pages, {pages_name} holds {size}",
                                    action="report it: the dump is inconsistent")
        with open(view / pm.name, "wb") as f:
            dump_pagemap({**img, "entries": [head, *new_entries]}, f, pycriu)
        rewritten |= {pm.name, pages_name}
    link_the_rest(images, view, rewritten)
    out.seconds = time.monotonic() - t0
    return out


def _read_writes(basis: Basis) -> None:
    """For each tracked process: what it did not write of what was pre-copied.  A process whose
    writes cannot be read is hashed instead (its digests are empty, so all of it travels)."""
    for d in basis.tasks.values():
        if d.tracker is None:
            continue
        try:
            d.unchanged = _subtract(d.copied, d.tracker.written())
        except OSError:
            d.unchanged = None


def _subtract(have: list[tuple[int, int]], minus: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint intervals `have` less the sorted, disjoint intervals `minus`."""
    out: list[tuple[int, int]] = []
    j = 0
    for a, b in have:
        while j < len(minus) and minus[j][1] <= a:
            j += 1
        k = j
        while a < b:
            if k >= len(minus) or minus[k][0] >= b:
                out.append((a, b))
                break
            if minus[k][0] > a:
                out.append((a, minus[k][0]))
            a = max(a, minus[k][1])
            k += 1
    return out


def _rewrite_tracked(src_path: Path, dst_path: Path, pm_name: str, entries: list[dict[str, Any]],
                     unchanged: list[tuple[int, int]], new_entries: list[dict[str, Any]], out: Delta) -> None:
    """One tracked process's pagemap and pages: unchanged runs become PE_PARENT, only the changed
    pages are copied (no page is read or hashed to decide)."""
    starts = [a for a, _ in unchanged]
    with open(src_path, "rb", buffering=0) as src, open(dst_path, "wb", buffering=0) as dst:
        size = os.fstat(src.fileno()).st_size
        off = 0
        for e in entries:
            flags, n, va = int(e["flags"]), int(e["nr_pages"]), int(e["vaddr"])
            if not flags & PE_PRESENT:
                new_entries.append(e)
                continue
            if off + n * PAGE > size:
                raise CaptureFailed(f"{pm_name} describes more pages than {src_path.name} holds",
                                    action="report it: the dump is inconsistent")
            for run_va, run_n, same in _cut(starts, unchanged, va, va + n * PAGE):
                if same:
                    new_entries.append({"vaddr": run_va, "compat_nr_pages": 0, "nr_pages": run_n,
                                        "flags": PE_PARENT | (flags & PE_LAZY)})
                    out.parent_bytes += run_n * PAGE
                else:
                    _copy_range(src.fileno(), dst.fileno(), off + run_va - va, run_n * PAGE)
                    new_entries.append({"vaddr": run_va, "compat_nr_pages": 0, "nr_pages": run_n, "flags": flags})
                    out.changed_bytes += run_n * PAGE
            off += n * PAGE
        if off != size:
            raise CaptureFailed(f"{pm_name} describes {off} bytes of pages, {src_path.name} holds {size}",
                                action="report it: the dump is inconsistent")


def _cut(starts: list[int], unchanged: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int, bool]]:
    """[a, b) as runs (vaddr, pages, unchanged)."""
    runs: list[tuple[int, int, bool]] = []
    i = max(0, bisect.bisect_right(starts, a) - 1)
    p = a
    while p < b:
        while i < len(unchanged) and unchanged[i][1] <= p:
            i += 1
        if i < len(unchanged) and unchanged[i][0] <= p:
            q = min(b, unchanged[i][1])
            runs.append((p, (q - p) // PAGE, True))
        else:
            q = min(b, unchanged[i][0]) if i < len(unchanged) else b
            runs.append((p, (q - p) // PAGE, False))
        p = q
    return runs


def _copy_range(src: int, dst: int, offset: int, count: int) -> None:
    """Append `count` bytes of `src` from `offset` to `dst`.  Read and written, not
    copy_file_range: between tmpfs files that goes through splice, 190 us a call here against
    20 us for a read and a write of the same runs (bench/delta_cost.py, 535 runs of a torch rank)."""
    while count > 0:
        data = os.pread(src, min(count, READ_CHUNK), offset)
        if not data:
            raise CaptureFailed("the dump's pages file ended early", action="report it: the dump is inconsistent")
        os.write(dst, data)
        offset += len(data)
        count -= len(data)


def _write_runs(digests: TaskDigests | None, va: int, flags: int, data: memoryview, dst: Any,
                new_entries: list[dict[str, Any]], out: Delta) -> None:
    """One group of the dump: unchanged runs become PE_PARENT entries, the rest is copied."""
    for run_va, run_n, same in _runs(digests, va, data):
        if same:
            new_entries.append({"vaddr": run_va, "compat_nr_pages": 0, "nr_pages": run_n,
                                "flags": PE_PARENT | (flags & PE_LAZY)})
            out.parent_bytes += run_n * PAGE
        else:
            a = run_va - va
            dst.write(data[a:a + run_n * PAGE])
            new_entries.append({"vaddr": run_va, "compat_nr_pages": 0, "nr_pages": run_n, "flags": flags})
            out.changed_bytes += run_n * PAGE


class _mapped:
    """A read-only, pre-faulted mapping of a pages file (tmpfs: its page cache, no copy): reading
    into fresh buffers cost five times as much here (fresh memory is dear on this VM)."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE) \
            if size else None
        self.view = memoryview(self._map) if self._map is not None else memoryview(b"")

    def __enter__(self) -> memoryview:
        return self.view

    def __exit__(self, *exc: object) -> None:
        try:
            self.view.release()
            if self._map is not None:
                self._map.close()
        except BufferError:  # a slice still held by an exception's frame: unmapped when that goes
            pass


def _groups(entries: list[dict[str, Any]]) -> list[Any]:
    """Present entries joined where they touch and agree in flags, as (vaddr, pages, flags): CRIU
    cuts its entries where it likes (1 MiB for lazy ones), and a cut inside a 64 KiB block would
    otherwise cost the block its digest.  A group ends at a block boundary once it is 64 MiB,
    so no more than that is held in memory.  Entries without pages pass through as they are."""
    out: list[Any] = []
    cur: list[int] | None = None
    for e in entries:
        flags, n, va = int(e["flags"]), int(e["nr_pages"]), int(e["vaddr"])
        if not flags & PE_PRESENT:
            if cur:
                out.append(tuple(cur))
                cur = None
            out.append(e)
            continue
        full = cur is not None and cur[1] * PAGE >= GROUP_BYTES and (cur[0] + cur[1] * PAGE) % BLOCK == 0
        if cur and cur[2] == flags and cur[0] + cur[1] * PAGE == va and not full:
            cur[1] += n
        else:
            if cur:
                out.append(tuple(cur))
            cur = [va, n, flags]
    if cur:
        out.append(tuple(cur))
    return out


def _runs(d: TaskDigests | None, vaddr: int, data: memoryview) -> list[tuple[int, int, bool]]:
    """Cut one dumped entry into runs (vaddr, pages, unchanged since the pre-copy)."""
    n = len(data) // PAGE
    if d is None:
        return [(vaddr, n, False)]
    runs: list[tuple[int, int, bool]] = []

    def add(va: int, k: int, same: bool) -> None:
        if runs and runs[-1][2] == same and runs[-1][0] + runs[-1][1] * PAGE == va:
            runs[-1] = (runs[-1][0], runs[-1][1] + k, same)
        else:
            runs.append((va, k, same))

    end = vaddr + n * PAGE
    p = vaddr
    while p < end:
        i = p - vaddr
        if p % BLOCK == 0 and p + BLOCK <= end and p in d.blocks:
            add(p, BLOCK_PAGES, _digest(data[i:i + BLOCK]) == d.blocks[p])
            p += BLOCK
            continue
        had = d.pages.get(p)
        add(p, 1, had is not None and _digest(data[i:i + PAGE]) == had)
        p += PAGE
    return runs


def describe_basis(b: Basis) -> dict[str, Any]:
    out: dict[str, Any] = {"bytes": b.bytes, "seconds": round(b.seconds, 4), "tasks": len(b.tasks),
                           "tracked_tasks": sum(1 for t in b.tasks.values() if t.tracker is not None)}
    if b.untracked:  # one reason is enough to act on; they are usually all the same
        out["untracked_tasks"] = len(b.untracked)
        out["untracked_reason"] = next(iter(b.untracked.values()))
    return out


def describe_delta(d: Delta) -> dict[str, Any]:
    return {"parent_bytes": d.parent_bytes, "changed_bytes": d.changed_bytes, "seconds": round(d.seconds, 4),
            "tracked_tasks": d.tracked_tasks, "digested_tasks": d.digested_tasks}

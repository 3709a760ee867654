"""Send a page once: copy-on-write pages of forked children become references on the wire.

CRIU dumps every process's private pages on its own, so a rank with DataLoader workers
ships the memory those children share with it (copy-on-write, never written since the
fork) once per child: measured 2026-11-29, 457 MB of a 701 MB dump of a rank with two
workers were pages already in the dump.  The sender keeps an index of the pages it has sent
in this stream and replaces a page it has sent before by a reference (a "C" frame, see
stream.py); the receiver copies those bytes from its own copy of the earlier file.

The index key is each page's xxh3-64 (about 0.5 us a page here).  A key match is only a
candidate: the bytes are compared with the earlier page before any reference is sent, so a
collision costs a missed saving, never a wrong page.  From a match the run is extended by
comparing the following pages with the pages following the earlier copy (in windows of
1 to 256 pages) (the usual shape:
a child's VMA against its parent's), so most duplicate pages are compared, not hashed, and
a run goes as one reference.  (A key sampled from a few words per page was tried
first and dropped: a forked Python child rewrites reference counts all over its pages, so
most sampled matches failed the compare, and the sender spent 1.2 s where it now spends
about 0.1 s per 700 MB.)
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash

PAGE = 4096
MAX_INDEXED = 4 << 20  # pages (16 GiB of images): the index stays under about 500 MB


@dataclass(frozen=True)
class Data:
    offset: int
    data: memoryview


@dataclass(frozen=True)
class Copy:
    offset: int
    length: int
    src_name: str
    src_offset: int


Segment = Data | Copy
ReadSent = Callable[[str, int, int], "bytes | memoryview"]


_libc = ctypes.CDLL(None, use_errno=True)
_memcmp = _libc.memcmp
_memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
_memcmp.restype = ctypes.c_int


def _equal(a: memoryview, b: memoryview) -> bool:
    """Byte equality at memcmp's speed: numpy's array_equal builds a bool per element first."""
    return len(a) == len(b) and _memcmp(np.frombuffer(a, np.uint8).ctypes.data,
                                        np.frombuffer(b, np.uint8).ctypes.data, len(a)) == 0


class PageIndex:
    """Where each distinct page already sent in this stream lies: (file name, offset)."""

    def __init__(self, max_pages: int = MAX_INDEXED) -> None:
        self._where: dict[int, tuple[str, int]] = {}
        self.max_pages = max_pages
        self.pages_referenced = 0

    @property
    def bytes_saved(self) -> int:
        return self.pages_referenced * PAGE

    def split(self, name: str, offset: int, data: bytes | memoryview, read_sent: ReadSent,
              sent_upto: Callable[[str], int]) -> list[Segment]:
        """Cut one piece of file `name` at `offset` into data to send and references to pages sent before.

        read_sent(name, offset, length) returns bytes already on the wire; sent_upto(name) says
        how far a file has been sent (for `name` itself: up to `offset`; pages earlier in this
        piece are read from `data`).
        """
        view = memoryview(data).cast("B")
        lead = -offset % PAGE  # bytes up to the next page boundary go as they are
        if lead:
            if lead >= len(view):
                return [Data(offset, view)]
            return [Data(offset, view[:lead]), *self.split(name, offset + lead, view[lead:], read_sent, sent_upto)]
        n_pages = len(view) // PAGE
        out: list[Segment] = []
        where, h = self._where, xxhash.xxh3_64_intdigest
        i = start = 0
        while i < n_pages:
            k = h(view[i * PAGE:(i + 1) * PAGE])
            src = where.get(k)
            if src is None:
                if len(where) < self.max_pages:
                    where[k] = (name, offset + i * PAGE)
                i += 1
                continue
            j = self._run(name, offset, view, i, n_pages, src, read_sent, sent_upto)
            if j == i:  # same key, other bytes
                i += 1
                continue
            if i > start:
                out.append(Data(offset + start * PAGE, view[start * PAGE:i * PAGE]))
            out.append(Copy(offset + i * PAGE, (j - i) * PAGE, src[0], src[1]))
            self.pages_referenced += j - i
            start = i = j
        if start * PAGE < len(view):
            out.append(Data(offset + start * PAGE, view[start * PAGE:]))
        return out

    @staticmethod
    def _run(name: str, offset: int, view: memoryview, i: int, n_pages: int, src: tuple[str, int],
             read_sent: ReadSent, sent_upto: Callable[[str], int]) -> int:
        """How far from page i the bytes equal those from `src` on: the end of the run (i: not even page i).

        Compared exactly, in windows that double (1, 2, 4 ... 256 pages) while they match; the
        first differing page of a window is found by halving.  A child's pages mostly follow its
        parent's in long runs, so most pages are compared without being hashed."""
        src_name, src_off = src
        inside = src_name == name and src_off >= offset  # earlier in this very piece
        limit = offset + i * PAGE if inside else sent_upto(src_name)
        longest = min(n_pages - i, (limit - src_off) // PAGE)

        def same(a: int, b: int) -> bool:
            so, n = src_off + (a - i) * PAGE, (b - a) * PAGE
            if inside:
                theirs = view[so - offset:so - offset + n]
            else:
                theirs = memoryview(read_sent(src_name, so, n)).cast("B")
            return len(theirs) == n and _equal(view[a * PAGE:b * PAGE], theirs)

        j, step = i, 1
        while j < i + longest:
            w = min(step, i + longest - j)
            if same(j, j + w):
                j, step = j + w, min(step * 2, 256)
                continue
            lo, hi = j, j + w  # [lo, hi) holds a differing page; [j, lo) are equal
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if same(lo, mid):
                    lo = mid
                else:
                    hi = mid
            return lo
        return j

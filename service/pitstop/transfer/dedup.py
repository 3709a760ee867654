"""Send a page once: copy-on-write pages of forked children become references on the wire.

CRIU dumps every process's private pages on its own, so a rank with DataLoader workers
ships the memory those children share with it (copy-on-write, never written since the
fork) once per child: measured 2026-11-29, 457 MB of a 701 MB dump of a rank with two
workers were pages already in the dump.  The sender keeps an index of the pages it has sent
in this stream and replaces a page it has sent before by a reference (a "C" frame, see
stream.py); the receiver copies those bytes from its own copy of the earlier file.

The index key samples 16 words of each page (cheap, vectorised with numpy); a key match is
only a candidate: the bytes are compared with the earlier page before any reference is sent,
so a collision costs a missed saving, never a wrong page.  Runs of consecutive pages whose
earlier copies are consecutive too (the usual shape: a child's VMA against its parent's) are
compared and sent as one reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

PAGE = 4096
_WORDS = PAGE // 8
_SAMPLE = np.linspace(0, _WORDS - 1, 16).astype(np.intp)
_MIX = np.random.default_rng(0x5EED).integers(1, 2**63, size=16, dtype=np.uint64) | np.uint64(1)
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


def _keys(view: memoryview, n_pages: int) -> list[int]:
    arr = np.frombuffer(view, dtype=np.uint64, count=n_pages * _WORDS).reshape(n_pages, _WORDS)
    with np.errstate(over="ignore"):
        return (arr[:, _SAMPLE] * _MIX).sum(axis=1, dtype=np.uint64).tolist()


class PageIndex:
    """Where each distinct page already sent in this stream lies: (file name, offset)."""

    def __init__(self, max_pages: int = MAX_INDEXED) -> None:
        self._where: dict[int, tuple[str, int]] = {}
        self.max_pages = max_pages
        self.pages_referenced = 0

    @property
    def bytes_saved(self) -> int:
        return self.pages_referenced * PAGE

    def split(self, name: str, offset: int, data: bytes | memoryview, read_sent: ReadSent) -> list[Segment]:
        """Cut one piece of file `name` at `offset` into data to send and references to pages sent before.

        read_sent(name, offset, length) returns bytes of this stream that are already on the wire
        (earlier pieces, or earlier in this piece): what a reference would copy on the receiver.
        """
        view = memoryview(data).cast("B")
        lead = -offset % PAGE  # bytes up to the next page boundary go as they are
        if lead:
            if lead >= len(view):
                return [Data(offset, view)]
            return [Data(offset, view[:lead]), *self.split(name, offset + lead, view[lead:], read_sent)]
        n_pages = len(view) // PAGE
        if n_pages == 0:
            return [Data(offset, view)]
        keys = _keys(view, n_pages)
        where = self._where
        cand: list[tuple[str, int] | None] = []
        for i, k in enumerate(keys):
            src = where.get(k)
            if src is None and len(where) < self.max_pages:
                where[k] = (name, offset + i * PAGE)
            cand.append(src)
        out: list[Segment] = []
        i = start = 0
        while i < n_pages:
            src = cand[i]
            if src is None:
                i += 1
                continue
            j = i + 1  # extend a run whose sources are consecutive in one file
            while j < n_pages and cand[j] is not None and cand[j] == (src[0], src[1] + (j - i) * PAGE):
                j += 1
            for a, b in self._confirmed(name, offset, view, i, j, src, read_sent):
                if a > start:
                    out.append(Data(offset + start * PAGE, view[start * PAGE:a * PAGE]))
                out.append(Copy(offset + a * PAGE, (b - a) * PAGE, src[0], src[1] + (a - i) * PAGE))
                self.pages_referenced += b - a
                start = b
            i = j
        if start * PAGE < len(view):
            out.append(Data(offset + start * PAGE, view[start * PAGE:]))
        return out

    @staticmethod
    def _confirmed(name: str, offset: int, view: memoryview, i: int, j: int, src: tuple[str, int],
                   read_sent: ReadSent) -> list[tuple[int, int]]:
        """The sub-runs of pages [i, j) whose bytes equal their earlier copies, compared exactly."""
        def earlier(a: int, b: int) -> memoryview:
            so, n = src[1] + (a - i) * PAGE, (b - a) * PAGE
            if src[0] == name and so >= offset:  # earlier in this very piece
                return view[so - offset:so - offset + n]
            return memoryview(read_sent(src[0], so, n)).cast("B")

        def same(a: int, b: int) -> bool:
            theirs = earlier(a, b)
            return len(theirs) == (b - a) * PAGE and np.array_equal(
                np.frombuffer(view[a * PAGE:b * PAGE], dtype=np.uint64), np.frombuffer(theirs, dtype=np.uint64))

        if same(i, j):
            return [(i, j)]
        runs: list[tuple[int, int]] = []  # rare: a sampled key matched a different page
        for p in range(i, j):
            if same(p, p + 1):
                if runs and runs[-1][1] == p:
                    runs[-1] = (runs[-1][0], p + 1)
                else:
                    runs.append((p, p + 1))
        return runs

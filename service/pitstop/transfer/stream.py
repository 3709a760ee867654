"""The image stream: files sent while CRIU is still writing them.

Why not dump-then-copy: the copy would start only after the dump ends, and
the job waits for both.  Why not CRIU's page server: it leaves no copy on the
source, and a stopped source is rolled back by restoring it from its own images
(it moved 1.1-1.3 GB/s here into warm memory, 340 MB/s into cold).
So the sender tails the image directory while CRIU writes it and ships each
file's new bytes as they appear; when the dump is over it sends the manifest
(sizes and digests of exactly what was streamed).  The receiver hashes as it
writes and checks the manifest before it calls the transfer complete.

Both ends overlap their disk work with the network: the sender reads and
hashes the next pieces in a thread while the current one is on the wire
(`_ahead`), the receiver writes and hashes a batch in a thread while the
next batch arrives (`receive_into`).  pread, pwrite and xxhash release the
GIL, so on two cores this roughly doubles the stream's rate.

This relies on CRIU writing image files append-only, which it does (each image
is a stream of protobuf records or raw pages); the sender still checks, and
fails the transfer if a file ever shrinks.

Wire format (one HTTP request body, chunked, or the data port's socket):
  b"D" !H name_len !Q offset !I length name data   a piece of a file
  b"C" !H name_len !Q offset !I length !H src_len !Q src_offset name src_name
                                                   a piece of a file equal to bytes of an
                                                   earlier piece (dedup.py: copy-on-write pages)
  b"Z" !H name_len !Q offset !I length !I zlength name zdata
                                                   a piece of a file, zstd-compressed; sent only to a
                                                   receiver that said it decodes them (compress.py)
  b"M" !I length json                              the manifest; the end
  b"E" !I length json                              the sender gave up; discard

Every length a header announces is bounded before anything is allocated or written for it
(`MAX_PIECE`, `MAX_MANIFEST`): the sender's pieces are at most `CHUNK` raw, so a larger one is a
corrupt or hostile stream, not an image.  A receiver with a `FreeSpace` also refuses a piece that
would leave its image directory's file system with less than a reserve free (a tmpfs is the
host's memory: filled, it takes the job's memory with it).
"""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import queue
import stat
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from pathlib import Path
from typing import Any

from pitstop.errors import DeadlineExceeded, IntegrityError, TransferFailed
from pitstop.transfer.compress import MAX_PIECE, Compression, Decoder
from pitstop.transfer.dedup import PAGE, Copy, PageIndex
from pitstop.transfer.manifest import DIGEST, MANIFEST, FileEntry, Manifest, new_hasher, verify

_D = struct.Struct("!HQI")
_C = struct.Struct("!HQIHQ")
_Z = struct.Struct("!HQII")
_L = struct.Struct("!I")
CHUNK = 4 << 20
SKIP_SUFFIXES = (".log",)
# What one frame may announce.  Data (D, C, Z): a piece is at most CHUNK raw bytes (dedup splits
# pieces, never joins them); MAX_PIECE leaves room for a larger CHUNK in a newer sender.  A manifest
# lists a few entries per process of the tree (about 150 bytes each): 16 MiB is over 100,000 files.
MAX_MANIFEST = 16 << 20
MiB = 1 << 20


def _skipped(name: str) -> bool:
    return name == MANIFEST or name.endswith(SKIP_SUFFIXES) or name.startswith(".")


class DirectoryTail:
    """Iterate the byte stream for a directory that is still being written.

    `finished` is set by whoever writes the directory (the dump) when it is
    complete; `manifest_base` then supplies the manifest fields other than the
    file list.  `failed` (an exception) aborts the stream with an E frame.
    """

    def __init__(self, directory: Path, *, poll_s: float = 0.003,
                 on_progress: Callable[[int], None] | None = None, dedup: bool = False,
                 compression: Compression | None = None) -> None:
        self.directory = directory
        self.compression = compression  # which data pieces go compressed (transfer/compress.py)
        self._wire = 0  # bytes of the stream handed on so far (the compression times pieces by it)
        # dedup: pages sent before go as references; worth its CPU only where the tree has
        # forked children sharing pages with their parent (capture decides)
        self.index = PageIndex() if dedup else None
        self.finished = threading.Event()
        self.failure: Exception | None = None
        self.manifest_base: Manifest | None = None
        self.poll_s = poll_s
        self.sent = 0
        self._on_progress = on_progress
        self._files: dict[str, tuple[int, int, Any]] = {}  # name -> (fd, offset, hash)
        self._maps: dict[str, memoryview] = {}  # name -> mapping of its sent bytes (the page index)
        self.manifest: Manifest | None = None

    def _scan_once(self) -> Iterator[bytes | memoryview]:
        try:
            names = sorted(os.listdir(self.directory))
        except FileNotFoundError:
            return
        for name in names:
            if _skipped(name):
                continue
            st = self._files.get(name)
            if st is None:
                try:
                    fd = os.open(self.directory / name, os.O_RDONLY)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    continue
                st = (fd, 0, new_hasher())
                self._files[name] = st
                bname = name.encode()
                yield b"D" + _D.pack(len(bname), 0, 0) + bname  # announces the file, even if empty
            fd, off, h = st
            size = os.fstat(fd).st_size
            if size < off:
                raise TransferFailed(f"image file {name} shrank while streaming ({size} < {off})",
                                     action="this CRIU does not write images append-only; report it")
            dedup = self.index is not None and name.startswith("pages-")
            if dedup and not self.finished.is_set():
                size = max(off, size - size % PAGE)  # whole pages only, until the dump is over: each can be indexed
            bname = name.encode()
            while off < size:
                data = _read(fd, off, min(CHUNK, size - off))
                h.update(data)
                if not dedup:
                    yield from self._data(bname, off, data)
                else:
                    for seg in self.index.split(name, off, data, self._read_sent, self._sent_upto):  # type: ignore[union-attr]
                        if isinstance(seg, Copy):
                            src = seg.src_name.encode()
                            yield (b"C" + _C.pack(len(bname), seg.offset, seg.length, len(src), seg.src_offset)
                                   + bname + src)
                        else:
                            yield from self._data(bname, seg.offset, seg.data)
                off += len(data)
                self.sent += len(data)
                if self._on_progress:
                    self._on_progress(self.sent)
            self._files[name] = (fd, off, h)

    def _data(self, bname: bytes, off: int, data: bytes | memoryview) -> Iterator[bytes | memoryview]:
        """One piece of a file's bytes: a D frame, or a Z frame where compressing it wins."""
        c = self.compression
        z, tried = c.encode(data) if c is not None else (None, False)
        if z is None:
            head, body = b"D" + _D.pack(len(bname), off, len(data)) + bname, data
        else:
            head, body = b"Z" + _Z.pack(len(bname), off, len(data), len(z)) + bname, z
        if c is not None:
            c.record(self._wire + len(head) + len(body), len(data), len(body), tried, z is not None)
        yield head
        yield body

    def _counted(self, pieces: Iterator[bytes | memoryview]) -> Iterator[bytes | memoryview]:
        try:
            for piece in pieces:
                self._wire += len(piece)
                yield piece
        finally:
            pieces.close()  # type: ignore[attr-defined]

    def _read_sent(self, name: str, off: int, n: int) -> memoryview:
        """Bytes of `name` already sent, from a mapping kept per file (the page index compares
        against earlier pages thousands of times per dump: no syscall or copy per compare)."""
        m = self._maps.get(name)
        if m is None or off + n > len(m):
            if m is not None:
                m.release()
            size = self._files[name][1]
            m = self._maps[name] = memoryview(mmap.mmap(self._files[name][0], size, prot=mmap.PROT_READ))
        return m[off:off + n]

    def _sent_upto(self, name: str) -> int:
        return self._files[name][1]

    def __iter__(self) -> Iterator[bytes | memoryview]:
        stop = threading.Event()
        return _ahead(_coalesced(self._counted(self._pieces(stop))), stop)

    def _pieces(self, stop: threading.Event) -> Iterator[bytes | memoryview]:
        try:
            while not stop.is_set():
                if self.failure is not None:
                    body = json.dumps({"message": str(self.failure)}).encode()
                    yield b"E" + _L.pack(len(body)) + body
                    return
                done = self.finished.is_set()
                got = False
                for piece in self._scan_once():
                    got = True
                    yield piece
                if done and self.failure is None:
                    if got:
                        continue  # one more pass: the dump was over before that scan began
                    m = (self.manifest_base or Manifest(capture_id="")).model_copy()
                    m.files = [FileEntry(name=n, size=off, digest=h.hexdigest())
                               for n, (_, off, h) in sorted(self._files.items())]
                    self.manifest = m
                    body = m.model_dump_json().encode()
                    yield b"M" + _L.pack(len(body)) + body
                    return
                if not got:
                    time.sleep(self.poll_s)
        finally:
            for view in self._maps.values():
                view.release()  # the mmap itself goes with its last view
            self._maps.clear()
            for fd, _, _ in self._files.values():
                os.close(fd)
            self._files.clear()


class FreeSpace:
    """Whether the next bytes of a stream fit in its directory's file system, with `reserve` left.

    Asked once per frame, before the frame's bytes are written; a refusal is a 507 that says how
    much was free.  statvfs is read again after at most `recheck` bytes, so that streams received
    side by side each see what the others wrote (together they may overshoot the reserve by at
    most `recheck` each: the reserve covers that)."""

    def __init__(self, directory: Path, reserve: int, *, what: str, setting: str = "",
                 recheck: int = 16 * MiB) -> None:
        self.directory, self.reserve, self.what, self.setting = directory, reserve, what, setting
        self.recheck = recheck
        self._budget = 0  # bytes that may still be written before statvfs is read again

    def free(self) -> int:
        st = os.statvfs(self.directory)
        return st.f_bavail * st.f_frsize

    def claim(self, n: int, received: int) -> None:
        """`n` more bytes are about to be written, `received` were written before them."""
        if n <= self._budget:
            self._budget -= n
            return
        free = self.free()
        if free - n < self.reserve:
            reserve = f", and {self.reserve // MiB} MiB stay free for the host ({self.setting})" if self.reserve else ""
            raise TransferFailed(
                f"not enough space for {self.what}: {free // MiB} MiB free in {self.directory} after "
                f"{received} bytes received, the next piece is {n} bytes{reserve}",
                code="destination_storage", http_status=507,
                action="the copy is discarded and the source resumed; free space in the destination's "
                       "image directory (a larger PITSTOP_AGENT_IMAGE_MOUNT_SIZE, fewer moves to it at "
                       "once) or pick another spare")
        self._budget = min(free - self.reserve, self.recheck) - n


def overdue(image_id: str, limit_s: float, received: int) -> DeadlineExceeded:
    """The error of a reception that outlived its deadline (the data port's and HTTP's alike)."""
    return DeadlineExceeded(
        f"image stream {image_id} did not complete within {limit_s:g} s ({received} bytes received)",
        action="the copy is discarded and the source resumed; check the link between the hosts, or raise "
               "PITSTOP_AGENT_TRANSFER_TIMEOUT_S on the destination (and the source) for larger images")


class StreamReceiver:
    """Parse an image stream into a directory, hashing as it writes.

    `space`: asked before each frame's bytes are written (FreeSpace); None: not checked."""

    def __init__(self, directory: Path, space: FreeSpace | None = None) -> None:
        self.directory = directory
        self.space = space
        directory.mkdir(parents=True, exist_ok=True)
        self.received = 0
        self.manifest: Manifest | None = None
        self._buf = bytearray()
        self._files: dict[str, tuple[int, int, Any]] = {}
        self._pending: tuple[str, int, int] | None = None  # name, offset, remaining
        self._zpending: tuple[str, int, int, bytearray, int] | None = None  # name, offset, raw size, body, filled
        self._decoder: Decoder | None = None
        self._readers: dict[str, int] = {}  # read fds of written files, for C frames
        self.written_stat: dict[str, tuple[int, int, int]] | None = None

    def feed_all(self, chunks: list[bytes]) -> None:
        for c in chunks:
            self.feed(c)

    def feed(self, chunk: bytes | bytearray | memoryview) -> None:
        """Consume one piece of the stream.  File data goes from `chunk` straight to disk and
        headers are parsed in place: only a header split across two pieces is ever buffered
        (this is the hot path of every move)."""
        if self.manifest is not None:
            raise TransferFailed("data after the end of the image stream", action="send again")
        mv = memoryview(chunk)
        while mv:
            if self._zpending is not None:
                mv = self._fill_z(mv)
                continue
            if self._pending is not None:
                name, off, remaining = self._pending
                take = min(remaining, len(mv))
                self._write(name, off, mv[:take])
                mv = mv[take:]
                remaining -= take
                self._pending = None if remaining == 0 else (name, off + take, remaining)
                continue
            if self.manifest is not None:
                raise TransferFailed("data after the end of the image stream", action="send again")
            if self._buf:  # the rest of a split header: complete it from this piece
                have = len(self._buf)
                self._buf += mv
                used = self._parse(memoryview(self._buf))
                if used == 0:
                    return  # still incomplete; all of `mv` is buffered
                self._buf = bytearray()
                mv = mv[used - have:]
                continue
            used = self._parse(mv)
            if used == 0:
                self._buf = bytearray(mv)  # a header cut by the end of this piece
                return
            mv = mv[used:]

    def _parse(self, view: memoryview) -> int:
        """Parse one frame header at the start of `view`; the bytes it took, 0 if incomplete.
        Its announced lengths are checked as soon as they are read, before anything is buffered."""
        kind = bytes(view[:1])
        if kind == b"D":
            if len(view) < 1 + _D.size:
                return 0
            nlen, off, n = _D.unpack_from(view, 1)
            _bounded("data piece", n, MAX_PIECE)
            if len(view) < 1 + _D.size + nlen:
                return 0
            name = self._name(bytes(view[1 + _D.size:1 + _D.size + nlen]))
            self._claim(n)
            if n == 0:
                self._write(name, off, b"")
            else:
                self._pending = (name, off, n)
            return 1 + _D.size + nlen
        if kind == b"C":
            if len(view) < 1 + _C.size:
                return 0
            nlen, off, n, slen, soff = _C.unpack_from(view, 1)
            _bounded("copied piece", n, MAX_PIECE)  # read whole into memory (_copy)
            end = 1 + _C.size + nlen + slen
            if len(view) < end:
                return 0
            name = self._name(bytes(view[1 + _C.size:1 + _C.size + nlen]))
            src = self._name(bytes(view[1 + _C.size + nlen:end]))
            self._claim(n)
            self._copy(name, off, n, src, soff)
            return end
        if kind == b"Z":
            if len(view) < 1 + _Z.size:
                return 0
            nlen, off, n, zn = _Z.unpack_from(view, 1)
            if len(view) < 1 + _Z.size + nlen:
                return 0
            name = self._name(bytes(view[1 + _Z.size:1 + _Z.size + nlen]))
            Decoder.check_sizes(name, n, zn)
            self._claim(n)
            self._zpending = (name, off, n, bytearray(zn), 0)
            return 1 + _Z.size + nlen
        if kind in (b"M", b"E"):
            if len(view) < 1 + _L.size:
                return 0
            (n,) = _L.unpack_from(view, 1)
            _bounded("manifest" if kind == b"M" else "error frame", n, MAX_MANIFEST)  # buffered whole
            if len(view) < 1 + _L.size + n:
                return 0
            body = bytes(view[1 + _L.size:1 + _L.size + n])
            if kind == b"E":
                raise TransferFailed("the sender aborted the transfer: " + json.loads(body).get("message", ""),
                                     action="the copy is discarded; the source keeps its images")
            self._finish(Manifest.model_validate_json(body))
            return 1 + _L.size + n
        raise TransferFailed(f"corrupt image stream (frame type {kind!r})", action="send again")

    def _claim(self, n: int) -> None:
        if self.space is not None and n:
            self.space.claim(n, self.received)

    def _fill_z(self, mv: memoryview) -> memoryview:
        """Take the next bytes of a compressed piece; once all are here, decode and write it."""
        name, off, n, body, filled = self._zpending  # type: ignore[misc]
        take = min(len(body) - filled, len(mv))
        body[filled:filled + take] = mv[:take]
        filled += take
        if filled < len(body):
            self._zpending = (name, off, n, body, filled)
        else:
            self._zpending = None
            self._decoder = self._decoder or Decoder()
            self._write(name, off, self._decoder.decode(name, body, n))
        return mv[take:]

    @staticmethod
    def _name(raw: bytes) -> str:
        name = raw.decode(errors="replace")
        if "/" in name or name in ("", ".", "..") or _skipped(name):
            raise TransferFailed(f"refusing image file name {name!r}", action="check the sender")
        return name

    def _copy(self, name: str, off: int, n: int, src: str, soff: int) -> None:
        """A C frame: bytes this receiver already wrote, at src/soff, repeated at name/off."""
        have = self._files.get(src)
        if n == 0 or have is None or soff + n > have[1]:
            raise TransferFailed(f"corrupt image stream: {name}@{off} refers to {n} bytes of {src}@{soff} "
                                 "that were not received", action="the copy is discarded; send again")
        fd = self._readers.get(src)
        if fd is None:
            fd = self._readers[src] = os.open(self.directory / src, os.O_RDONLY)
        data = os.pread(fd, n, soff)
        if len(data) != n:
            raise TransferFailed(f"{src} is shorter than what was written to it", action="send again")
        self._write(name, off, data)

    def _write(self, name: str, off: int, data: bytes | memoryview) -> None:
        st = self._files.get(name)
        if st is None:
            fd = os.open(self.directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            st = (fd, 0, new_hasher())
        fd, cur, h = st
        if off != cur:
            raise TransferFailed(f"{name}: piece at offset {off}, expected {cur}", action="send again")
        os.pwrite(fd, data, off)
        h.update(data)
        self._files[name] = (fd, cur + len(data), h)
        self.received += len(data)

    def _finish(self, m: Manifest) -> None:
        self.close()
        got = {n: (off, h.hexdigest()) for n, (_, off, h) in self._files.items()}
        if m.digest_algorithm != DIGEST:
            raise IntegrityError(f"the sender's manifest uses digest {m.digest_algorithm!r}, this agent {DIGEST!r}",
                                 action="run the same pitstop version on both agents, then move again")
        want = {f.name: (f.size, f.digest) for f in m.files}
        if got != want:
            bad = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
            raise IntegrityError(f"received images differ from the sender's manifest: {', '.join(bad[:5])}",
                                 action="the copy is discarded; send again")
        m.write(self.directory)
        self.manifest = m
        self.written_stat = file_stats(self.directory, m)

    def close(self) -> None:
        for fd in [fd for fd, _, _ in self._files.values()] + list(self._readers.values()):
            try:
                os.close(fd)
            except OSError:
                pass
        self._files = {n: (-1, off, h) for n, (_, off, h) in self._files.items()}
        self._readers.clear()

    @property
    def complete(self) -> bool:
        return self.manifest is not None


def _bounded(what: str, n: int, limit: int) -> None:
    if n > limit:
        raise TransferFailed(f"corrupt image stream: a {what} claims {n} bytes (at most {limit})",
                             action="the copy is discarded; check that both agents run the same pitstop version")


_END = object()
_PAGE = mmap.ALLOCATIONGRANULARITY


def _read(fd: int, off: int, n: int) -> bytes | memoryview:
    """`n` bytes at `off`: mapped, not copied, when the piece is big (the pages of a dump are
    shared with the page cache; the mapping lives as long as the piece).  Safe because image
    files only grow, and the piece covers bytes already written."""
    if n < (256 << 10):
        return os.pread(fd, n, off)
    base = off - off % _PAGE
    m = mmap.mmap(fd, off + n - base, prot=mmap.PROT_READ, offset=base)
    return memoryview(m)[off - base:]


def _coalesced(pieces: Iterator[bytes | memoryview],
               small: int = 64 << 10) -> Generator[bytes | memoryview, None, None]:
    """Join runs of small pieces (frame headers, references, a few pages between references) into
    one: each piece costs the sender a syscall, a TLS record or an HTTP chunk of its own."""
    buf = bytearray()
    try:
        for piece in pieces:
            if len(piece) < small:
                buf += piece
                if len(buf) >= small:
                    yield bytes(buf)
                    buf.clear()
                continue
            if buf:
                yield bytes(buf)
                buf.clear()
            yield piece
        if buf:
            yield bytes(buf)
    finally:
        pieces.close()  # type: ignore[attr-defined]


def _ahead(pieces: Generator[bytes | memoryview, None, None], stop: threading.Event,
           depth: int = 8) -> Iterator[bytes | memoryview]:
    """Run `pieces` in a thread, up to `depth` pieces ahead of the consumer.

    Closing this generator (the consumer gave up) sets `stop`, which `pieces`
    also watches while it waits for the dump, then closes `pieces`, so its
    files are closed in every case."""
    q: queue.Queue = queue.Queue(maxsize=depth)

    def put(item: object) -> bool:
        """Queue `item` unless the consumer gave up first."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for piece in pieces:
                if not put(piece):
                    return
            item: object = _END
        except BaseException as e:  # handed to the consumer, raised there
            item = e
        finally:
            pieces.close()
        put(item)

    t = threading.Thread(target=produce, name="stream-read-ahead", daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        t.join(timeout=5)


async def receive_into(rx: StreamReceiver, chunks: AsyncIterator[bytes], batch_bytes: int = 4 << 20) -> None:
    """Feed an HTTP body to `rx`, writing one batch in a thread while the next arrives.

    At most two batches are held (about 2 x batch_bytes); an error from a write
    (ENOSPC above all) is raised here, at the next batch or at the end."""
    loop = asyncio.get_running_loop()
    pending: asyncio.Future | None = None
    batch: list[bytes] = []
    size = 0
    try:
        async for chunk in chunks:
            if not chunk:
                continue
            batch.append(chunk)
            size += len(chunk)
            if size >= batch_bytes:
                if pending is not None:
                    await pending
                pending = loop.run_in_executor(None, rx.feed_all, batch)
                batch, size = [], 0
        if pending is not None:
            await pending
            pending = None
        if batch:
            await loop.run_in_executor(None, rx.feed_all, batch)
    finally:
        if pending is not None and not pending.done():
            await asyncio.wait([pending])  # never leave a write running on a slot being discarded


def file_stats(directory: Path, m: Manifest) -> dict[str, tuple[int, int, int]]:
    """(size, mtime_ns, inode) of each image file: any change to a file changes these."""
    out = {}
    for f in m.files:
        try:
            st = (directory / f.name).stat()
            out[f.name] = (st.st_size, st.st_mtime_ns, st.st_ino)
        except FileNotFoundError:
            out[f.name] = (-1, -1, -1)
    return out


def verify_directory(directory: Path) -> Manifest:
    """Re-read the images at rest and check them against their manifest."""
    m = Manifest.read(directory)
    verify(directory, m)
    return m

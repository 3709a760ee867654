"""Compression of the image stream, only where it wins.

Why it can win: a rank's images compress well.  A CRIU dump of the reference job's torch rank
(its own memory, no ballast) went to 21 % of its size with zstd level 1, 4 MiB at a time
(2026-12-02).  Why it often loses: on this testbed zstd compresses at 0.25-0.6 GB/s per core and
decompresses at 1.0-1.5 GB/s, while loopback moves 3-4 GB/s; on a 100 Gb/s link (12.5 GB/s)
compression would slow every move.  Both the link and the compressor's speed differ from host
to host and from moment to moment (the job competes for the cores during a pre-copy, not during
the pause), so the sender measures instead of guessing:

- a stream carries each 4 MiB data piece either raw (D frame) or compressed (Z frame, stream.py);
  the receiver says in the data port's hello that it can decode Z frames, and until it has, every
  piece goes raw, so an older agent never sees one;
- `auto` keeps, per destination, the end-to-end rate of each arm (raw bytes per second from one
  piece leaving the socket to the next: that includes the link, the receiver's backpressure and,
  for the compressed arm, the compressor), sends each piece the faster way, and now and then tries
  the other; the compressed arm is only tried when a 256 KiB sample says it could win (it
  compresses to at most `PROMISING_RATIO` and faster than the raw arm moves) and the raw arm's
  pieces wait in the socket (the link, not the stream's own source, sets their pace), which keeps
  the cost of looking on a fast link to one small sample now and then;
- what was learned outlives the stream: the pause's short delta uses what the pre-copy to the same
  destination measured;
- towards this machine's own loopback `auto` does not compress at all (`same_host`).

It decides by arm, not piece by piece: a stretch of a stream unlike what was last measured goes
the old way until the next look (16-256 pieces later).  bench/compress_link.py measures it.

Digests stay on the raw bytes at both ends, so the manifest check is the same end-to-end check with
or without compression.
"""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import zstandard

from pitstop.errors import TransferFailed

ENCODING = "zstd"
Mode = Literal["auto", "on", "off"]

MIN_PIECE = 64 << 10            # smaller pieces go raw: the frame and the call cost more than they save
MAX_PIECE = 64 << 20            # a Z frame's sizes are bounded (a corrupt or hostile header allocates nothing)
KEEP_RATIO = 0.97               # a compressed piece is sent only if it is at most this size of the raw one
SAMPLE = 256 << 10              # what a look at the compressed arm compresses first
PROMISING_RATIO = 0.95          # the sample must shrink to this (float32 weights: about 0.92) ...
PROMISING_SPEEDUP = 1.25        # ... and compress this much faster than the raw arm moves bytes,
LINK_BOUND = 0.5                # ... whose pieces spent at least this share of their time in the socket:
                                # one that waits for its pieces (a dump still being written, a pre-copy
                                # reading memory) is not slowed by the link, and compressing cannot help it
WIN_MARGIN = 1.05               # the compressed arm must be this much faster to be used
# What is not measured, because it says nothing about an arm's rate:
# - the start of a stream: the socket buffers at both ends and a slow link's queue take the first
#   megabytes at once (up to about 16 MB here);
# - the first compressed pieces after raw ones: the read-ahead, up to 4 data pieces ahead of the
#   socket, compressed them while the raw ones were on the wire;
# - the first 4 raw pieces after compressed ones: where the compressor was the bottleneck the
#   buffers had drained, and take them at once (a look at raw then read 3.6 GB/s on a 1 Gbit/s
#   link); where the link was, they wait for the compressed bytes ahead of them.
START_UNMEASURED = 16 << 20
SETTLE = {True: 5, False: 4}
MEASURED_PER_LOOK = {True: 4, False: 2}  # a look at the other arm: its settling pieces and these many more
EXPLORE_FIRST, EXPLORE_MAX = 16, 256     # pieces between looks; doubles with each look
EWMA = 0.3
KEEP = 0.75  # what an arm's byte and second counts keep at each measurement: a rate of the last few


def same_host(host: str) -> bool:
    """Whether `host` is this machine's loopback: there both ends of the stream share its cores, the
    bytes cost memory copies, not a link, and compressing only adds work (measured: a move between
    two agents on loopback streams at 0.3-0.4 GB/s while CRIU dumps, its pieces waiting in the
    socket for a receiver short of CPU, and zstd on the same cores runs at 0.25-0.45 GB/s)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_threads() -> int:
    """zstd's worker threads: none on a small host (the sender's thread compresses), else a
    quarter of the cores, at most 8.  During the pause the job's own threads are stopped."""
    n = os.cpu_count() or 1
    return 0 if n <= 4 else min(8, n // 4)


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - EWMA) * old + EWMA * new


@dataclass
class Link:
    """What this agent learned about sending to one destination.

    An arm's rate is decayed bytes over decayed seconds, not an average of per-piece rates: pieces
    that compress to a few KiB leave the socket together with the next, in no time of their own."""

    # per arm: decayed raw bytes, seconds, and seconds of those spent in sendall()
    counts: dict[bool, list[float]] = field(default_factory=lambda: {False: [0.0, 0.0, 0.0], True: [0.0, 0.0, 0.0]})
    sample_rate: float | None = None   # the compressor's raw B/s on samples
    sample_ratio: float | None = None
    explore_every: int = EXPLORE_FIRST

    def rate(self, compressed: bool) -> float | None:
        """Raw bytes per second through the whole path, for pieces sent this way; None: not measured."""
        b, s, _ = self.counts[compressed]
        return b / s if s > 0 else None

    def socket_share(self, compressed: bool) -> float:
        """How much of an arm's time its pieces spent in the socket: near 1 where the link (or the
        receiver behind it) sets the pace, near 0 where the stream waits for its own pieces."""
        _, s, k = self.counts[compressed]
        return k / s if s > 0 else 0.0

    def measured(self, compressed: bool, raw: int, seconds: float, in_socket: float) -> None:
        c = self.counts[compressed]
        c[0], c[1], c[2] = c[0] * KEEP + raw, c[1] * KEEP + seconds, c[2] * KEEP + min(in_socket, seconds)



_links: dict[str, Link] = {}
_links_lock = threading.Lock()


def link_for(key: str) -> Link:
    with _links_lock:
        return _links.setdefault(key, Link())


class Compression:
    """The sending side of one stream: which pieces go compressed, and what it cost.

    `encode` runs in the stream's read-ahead thread, `sent` in the thread that writes the socket;
    they meet through a queue of (wire offset where a piece ends, raw bytes, whether compressing
    was tried)."""

    def __init__(self, mode: Mode, *, level: int = 1, threads: int | None = None, link: Link | None = None,
                 reason: str | None = None) -> None:
        self.mode = mode
        self.reason = reason  # why the mode is not the one asked for, where it is not
        self.level = level
        self.threads = default_threads() if threads is None else threads
        self.link = link or Link()
        self.allowed = False  # the receiver said it decodes Z frames (dataport.send sets it)
        self._zc = zstandard.ZstdCompressor(level=level, threads=self.threads) if mode != "off" else None
        self._inflight: deque[tuple[int, int, bool]] = deque()
        self._lock = threading.Lock()
        self._last_done: float | None = None
        self._in_socket = 0.0  # seconds in sendall() since the last piece ended
        self._run: tuple[bool, int] = (False, 0)    # the arm of the last pieces sent, how many in a row
        self._look: tuple[bool, int] = (False, 0)   # a look under way: its arm, pieces still to send
        self._since_look = 0
        self._fresh = True  # this stream has not looked yet
        self.raw_bytes = self.wire_bytes = self.pieces = self.compressed_pieces = self.samples = 0

    def accept(self, encodings: Any) -> None:
        """The receiver's hello: compress only for one that decodes it."""
        self.allowed = self.mode != "off" and isinstance(encodings, list) and ENCODING in encodings

    # -- read-ahead thread -------------------------------------------------------------------------
    def encode(self, data: bytes | memoryview) -> tuple[bytes | None, bool]:
        """(the compressed form of `data` if it goes compressed, else None; whether compressing was
        tried: a piece that did not shrink goes raw, but its time counts for the compressed arm)."""
        if not self.allowed or self._zc is None or not MIN_PIECE <= len(data) <= MAX_PIECE:
            return None, False
        if not self._choose(data):
            return None, False
        z = self._zc.compress(data)
        return (z if len(z) <= KEEP_RATIO * len(data) else None), True

    def record(self, wire_end: int, raw: int, wire: int, tried: bool, compressed: bool) -> None:
        """A data piece was framed; it ends at byte `wire_end` of the stream."""
        with self._lock:
            if self.allowed:  # else nothing times the socket (an older receiver, the HTTP path)
                self._inflight.append((wire_end, raw, tried))
            self.pieces += 1
            self.raw_bytes += raw
            self.wire_bytes += wire
            self.compressed_pieces += compressed

    def _choose(self, data: bytes | memoryview) -> bool:
        if self.mode == "on":
            return True
        arm, left = self._look
        if left > 0:
            self._look = (arm, left - 1)
            return arm
        lk = self.link
        if lk.rate(False) is None:
            return False  # the link is measured raw first
        winner = self._winner()
        self._since_look += 1
        # A stream where raw won before takes one sample of its own first: what was learned came
        # from other bytes (the tail of the last stream), and a sample costs little.  One where
        # compressing won trusts it: the pause's delta is a few pieces, too few for a look.
        fresh, self._fresh = self._fresh and not winner, False
        if self._since_look < lk.explore_every and lk.sample_rate is not None and not fresh:
            return winner
        self._since_look = 0
        if lk.sample_rate is not None and not fresh:  # the first sample comes as soon as the link is measured
            lk.explore_every = min(EXPLORE_MAX, lk.explore_every * 2)
        if not winner:  # is compressing worth a try?  A sample says whether it could win at all
            self._sample(data)
            if not (lk.sample_ratio <= PROMISING_RATIO  # type: ignore[operator]
                    and lk.sample_rate >= PROMISING_SPEEDUP * lk.rate(False)  # type: ignore[operator]
                    and lk.socket_share(False) >= LINK_BOUND):
                return False
        self._look = (not winner, SETTLE[not winner] + MEASURED_PER_LOOK[not winner] - 1)
        return not winner

    def _winner(self) -> bool:
        """Whether the compressed arm is the faster one, by what was measured."""
        raw, z = self.link.rate(False), self.link.rate(True)
        return raw is not None and z is not None and z > raw * WIN_MARGIN

    def _sample(self, data: bytes | memoryview) -> None:
        mid = max(0, len(data) // 2 - SAMPLE // 2)
        part = data[mid:mid + SAMPLE]
        t0 = time.perf_counter()
        z = self._zc.compress(part)  # type: ignore[union-attr]
        dt = max(time.perf_counter() - t0, 1e-6)
        self.samples += 1
        self.link.sample_rate = _ewma(self.link.sample_rate, len(part) / dt)
        self.link.sample_ratio = _ewma(self.link.sample_ratio, len(z) / max(1, len(part)))

    # -- socket thread -----------------------------------------------------------------------------
    def started(self) -> None:
        """The receiver answered: the first piece is timed from here."""
        self._last_done = time.perf_counter()

    def sent(self, wire_total: int, in_socket: float) -> None:
        """`wire_total` bytes of the stream are in the socket, the last of them after `in_socket`
        seconds in sendall(): time the pieces that ended there.

        The time since the last piece ended goes to the pieces that end now (one, or several that
        left the socket in one call), if they are of one arm and past its settling."""
        now = time.perf_counter()
        with self._lock:
            self._in_socket += in_socket
            done: list[tuple[int, bool]] = []
            while self._inflight and self._inflight[0][0] <= wire_total:
                _, raw, tried = self._inflight.popleft()
                if raw >= MIN_PIECE:  # headers and small files take no time worth a rate
                    arm, n = self._run
                    self._run = (tried, n + 1 if arm == tried else 1)
                    done.append((raw, tried))
            if not done:
                return
            arms = {t for _, t in done}
            if (self._last_done is not None and len(arms) == 1 and self._run[1] > SETTLE[self._run[0]]
                    and wire_total > START_UNMEASURED):
                self.link.measured(self._run[0], sum(r for r, _ in done), max(now - self._last_done, 1e-6),
                                   self._in_socket)
            self._last_done, self._in_socket = now, 0.0

    def summary(self) -> dict[str, Any]:
        lk = self.link
        return {"mode": self.mode, **({"reason": self.reason} if self.reason else {}), "encoding": ENCODING if self.allowed else None, "level": self.level,
                "threads": self.threads, "pieces": self.pieces, "compressed_pieces": self.compressed_pieces,
                "raw_bytes": self.raw_bytes, "wire_bytes": self.wire_bytes, "samples": self.samples,
                "raw_gbps": None if lk.rate(False) is None else round(lk.rate(False) / 1e9, 3),  # type: ignore[operator]
                "compressed_gbps": None if lk.rate(True) is None else round(lk.rate(True) / 1e9, 3),  # type: ignore[operator]
                "raw_socket_share": round(lk.socket_share(False), 3)}


class Decoder:
    """The receiving side: one decompressor per stream, sizes checked before and after."""

    def __init__(self) -> None:
        self._zd = zstandard.ZstdDecompressor()

    @staticmethod
    def check_sizes(name: str, raw: int, wire: int) -> None:
        if not (0 < raw <= MAX_PIECE and 0 < wire <= MAX_PIECE):
            raise TransferFailed(f"corrupt image stream: compressed piece of {name} claims {wire} -> {raw} bytes "
                                 f"(at most {MAX_PIECE} each)", action="the copy is discarded; send again")

    def decode(self, name: str, z: bytes | bytearray | memoryview, raw: int) -> bytes:
        try:
            out = self._zd.decompress(z, max_output_size=raw)
        except zstandard.ZstdError as e:
            raise TransferFailed(f"corrupt compressed piece of {name}: {e}",
                                 action="the copy is discarded; send again") from None
        if len(out) != raw:
            raise TransferFailed(f"compressed piece of {name} gave {len(out)} bytes, its frame said {raw}",
                                 action="the copy is discarded; send again")
        return out

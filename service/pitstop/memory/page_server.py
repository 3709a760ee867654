"""Serve lazy pages to a destination's `criu lazy-pages` daemon from the source's full dump.

The daemon speaks CRIU's page-server protocol (criu/page-xfer.c) over a socket pitstop hands it
(`--ps-socket`): the destination agent opens it to this agent's data port, authenticated like
an image stream, so no port of CRIU's own is exposed.  What the daemon sends, and what we do:

  PS_IOV_GET {nr_pages, vaddr, dst_id=task's pid}  ->  PS_IOV_ADD_F header + the pages
                                                      (fewer than asked at an entry's end:
                                                      the protocol allows it)
  PS_IOV_CLOSE / PS_IOV_FORCE_CLOSE                ->  int32 0: every page arrived; we are done

Anything else, or a page the dump does not hold lazily, ends the connection: the daemon then
fails, and the destination stops the worker rather than let it read zeros
(agent/receiving.py, _watch_fill).  Replies go out with TCP_NODELAY: the daemon waits for each
reply before it asks again, and Nagle's algorithm against its delayed ACKs cost 44 ms a reply
(a 1 GiB fill took 4.0 s instead of 0.7 s).
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from pitstop.memory.postcopy import PAGE, PE_PRESENT, LazySplit

log = structlog.get_logger("pitstop.transfer.pages")

PSI = struct.Struct("<I4xQQQ")  # struct page_server_iov {u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id}
PS_IOV_ADD_F = 6
PS_IOV_GET = 7
PS_IOV_CLOSE = 0x1023
PS_IOV_FORCE_CLOSE = 0x1024
PS_CMD_BITS = 16
PS_CMD_MASK = (1 << PS_CMD_BITS) - 1


class ProtocolError(Exception):
    pass


@dataclass
class Served:
    pages: int = 0
    requests: int = 0
    seconds: float = 0.0
    closed_cleanly: bool = False


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        if not b:
            return None if not buf else bytes(buf)
        buf += b
    return bytes(buf)


def serve(sock: socket.socket, split: LazySplit, *, idle_timeout_s: float,
          stop_after: int | None = None, stall_after: int | None = None,
          faults_from: Callable[[], bool] | None = None,
          on_progress: Callable[[Served], None] | None = None) -> Served:
    """Answer one daemon until it says it is done.  Raises ProtocolError, OSError or TimeoutError.

    idle_timeout_s bounds each wait for the next request (the daemon asks continuously while it
    fills).  Fault hooks: stop_after, drop the connection after that many pages; stall_after,
    stop answering then (a hung host) until the other side gives up.  Both count the pages served
    from the first request at which `faults_from()` is true, where given (the agent's
    `postcopy:faults_from=commit`: once the move committed, so that a fault meant for the fill
    never lands in the restore, however many pages the restore took)."""
    sock.settimeout(idle_timeout_s)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    fds: dict[tuple[int, int], int] = {}
    out = Served()
    counted_from: int | None = None  # out.pages when the fault hooks began to count
    t0 = time.monotonic()
    try:
        while True:
            raw = _recv_exact(sock, PSI.size)
            if raw is None:
                raise ProtocolError(f"the lazy-pages daemon hung up after {out.pages} pages without saying it was done")
            if len(raw) != PSI.size:
                raise ProtocolError("a truncated request")
            cmd, nr, vaddr, dst = PSI.unpack(raw)
            if cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                sock.sendall(struct.pack("<i", 0))
                out.closed_cleanly = True
                return out
            if cmd & PS_CMD_MASK != PS_IOV_GET:
                raise ProtocolError(f"unexpected page-server command {cmd:#x}")
            task = split.tasks.get(dst)
            where = task.locate(vaddr, nr) if task else None
            if where is None or nr == 0:
                raise ProtocolError(f"task {dst} asked for {nr} pages at {vaddr:#x}, which the dump does not "
                                    "hold as lazy pages")
            fi, off, n = where
            if counted_from is None and (faults_from is None or faults_from()):
                counted_from = out.pages
            counted = None if counted_from is None else out.pages - counted_from + n
            if stop_after is not None and counted is not None and counted > stop_after:
                raise ProtocolError(f"injected fault: page server stopped after {out.pages} pages")
            if stall_after is not None and counted is not None and counted > stall_after:
                while sock.recv(1 << 16):  # until the destination hangs up (or the idle timeout)
                    pass
                raise ProtocolError(f"injected fault: page server stalled after {out.pages} pages")
            fd = fds.get((dst, fi))
            if fd is None:
                fd = fds[(dst, fi)] = os.open(task.files[fi], os.O_RDONLY)  # type: ignore[union-attr]
            sock.sendall(PSI.pack((PE_PRESENT << PS_CMD_BITS) | PS_IOV_ADD_F, n, vaddr, dst))
            _send_range(sock, fd, off, n * PAGE, idle_timeout_s)
            out.pages += n
            out.requests += 1
            if on_progress:
                on_progress(out)
    finally:
        out.seconds = time.monotonic() - t0
        for fd in fds.values():
            os.close(fd)


def _send_range(sock: socket.socket, fd: int, off: int, n: int, timeout_s: float) -> None:
    """From the page cache to the socket (sendfile): the agent does not copy the pages."""
    while n:
        try:
            k = os.sendfile(sock.fileno(), fd, off, n)
        except BlockingIOError:  # the socket has a timeout, so it is non-blocking underneath
            if not select.select([], [sock], [], timeout_s)[1]:
                raise TimeoutError(f"the lazy-pages daemon took no data for {timeout_s:g} s") from None
            continue
        if k == 0:
            raise ProtocolError("the dump's pages file is shorter than its pagemap says")
        off += k
        n -= k

"""Stand between the destination's lazy-pages daemon and the source's page server.

Why this exists: after a post-copy restore over the network, the moved worker's untouched
pages live on the source.  If the source stops serving (its host dies, its agent fails, the
link hangs), CRIU's daemon fails and exits; the kernel then drops the worker's userfaultfd
and every page never filled reads as zeros.  Killing the worker after the daemon has exited
is too late: measured here, a worker read zeros and died of SIGSEGV 16 ms after the source
hung up, before the agent had seen the daemon go.  A worker that happens not to crash would
compute on zeros and feed them to the other ranks' collectives.

So the daemon never talks to the source directly.  It gets one end of a socketpair; this
relay holds the other end and the TCP connection to the source.  When the source hangs up,
answers something that is not a reply, or goes silent while a request is outstanding
(`idle_timeout_s`), the relay SIGKILLs the worker's whole process tree *first*, waits until
it is gone, and only then closes the daemon's side.  The daemon's userfaultfd outlives the
worker, so no page of it is ever read as zero.

It is a process of its own, not a thread of the agent: like the daemon, it must outlive an
agent restart (the agent places both in the worker's fill scope).  The agent tells it which
tree to guard once the restore has returned (`guard` line on stdin) and reads back one line:
`ok`, or `failed <reason>` if the source had already gone (the restore then rolls back).
When the fill ends the relay prints one JSON line: {"ok", "reason", "bytes", "pages"}.

The relay parses only the fixed-size frames of CRIU's page-server protocol
(memory/page_server.py) to know whether a reply is outstanding and whether the daemon has
said it is done; it copies the pages without looking at them.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pitstop.memory.page_server import PS_CMD_MASK, PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE, PS_IOV_GET, PSI
from pitstop.memory.postcopy import PAGE
from pitstop.proc import proctree

CLOSE_REPLY = 4  # int32 status after PS_IOV_CLOSE / FORCE_CLOSE


@dataclass
class _Frames:
    """Where each direction of the conversation stands, frame by frame."""

    requests: bytearray = field(default_factory=bytearray)  # a partial request from the daemon
    expect: deque[str] = field(default_factory=deque)        # replies owed: "pages" or "close"
    header: bytearray = field(default_factory=bytearray)     # a partial reply header
    body_left: int = 0                                        # bytes still to come of the reply under way
    closed: bool = False                                      # the close reply has arrived whole
    pages: int = 0

    def from_daemon(self, data: bytes) -> None:
        self.requests += data
        while len(self.requests) >= PSI.size:
            cmd, _nr, _vaddr, _dst = PSI.unpack_from(self.requests)
            del self.requests[:PSI.size]
            if cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                self.expect.append("close")
            elif cmd & PS_CMD_MASK == PS_IOV_GET:
                self.expect.append("pages")
            else:
                raise ValueError(f"the lazy-pages daemon sent command {cmd:#x}, which pitstop's page "
                                 "server does not answer")

    def from_source(self, data: memoryview) -> None:
        i = 0
        while i < len(data):
            if self.body_left:  # the pages of a reply, or the status of a close
                k = min(self.body_left, len(data) - i)
                self.body_left -= k
                i += k
                if not self.body_left:
                    self._reply_done()
                continue
            if not self.expect:
                raise ValueError("the source sent bytes no request asked for")
            if self.expect[0] == "close":
                self.body_left = CLOSE_REPLY
                continue
            k = min(PSI.size - len(self.header), len(data) - i)
            self.header += data[i:i + k]
            i += k
            if len(self.header) == PSI.size:
                _cmd, nr, _vaddr, _dst = PSI.unpack(self.header)
                self.header.clear()
                self.pages += nr
                self.body_left = nr * PAGE
                if not self.body_left:
                    self._reply_done()

    def _reply_done(self) -> None:
        self.closed = self.expect.popleft() == "close" or self.closed

    @property
    def outstanding(self) -> bool:
        return bool(self.expect)


class Guardian:
    """The control pipe from the agent, and the rule that the worker goes before the daemon does.

    The agent names the restored tree once the restore has returned (`guard <pid>`); it is told
    `ok`, or `failed <why>` when the pages had already stopped coming (the tree is killed).  When
    serving fails later, `settle` kills the tree, waiting for its pid if the restore still runs,
    and only then may the daemon's socket close.  Shared by the relay and the local page server
    (memory/local_pages.py)."""

    def __init__(self, ctl_in: int, ctl_out, guard_timeout_s: float) -> None:  # noqa: ANN001
        self.ctl_in, self.ctl_out, self.guard_timeout_s = ctl_in, ctl_out, guard_timeout_s
        self.guard: int | None = None
        self.failure: str | None = None
        self.ctl_open = True
        self._buf = b""

    def say(self, line: str) -> None:
        try:
            self.ctl_out.write(line + "\n")
            self.ctl_out.flush()
        except OSError:
            pass  # the agent went away (restarted): guarding goes on without it

    def read_ctl(self) -> None:
        """One read of the agent's control pipe (it is readable)."""
        data = os.read(self.ctl_in, 256)
        if not data:
            self.ctl_open = False
            return
        self._buf += data
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            word, _, arg = line.decode().partition(" ")
            if word == "guard" and arg.strip().isdigit():
                self.guard = int(arg)
                if self.failure:  # the pages stopped while the restore ran: this tree must not run
                    proctree.kill_tree(self.guard)
                    self.say(f"failed {self.failure}")
                else:
                    self.say("ok")

    def settle(self) -> list[int]:
        """After a failure: the pids killed (none if the restore never named its tree in time)."""
        if not self.failure:
            return []
        if self.guard is None and self.ctl_open:  # the restore is still running: wait for its pid
            deadline = time.monotonic() + self.guard_timeout_s
            while self.guard is None and self.ctl_open and time.monotonic() < deadline:
                if select.select([self.ctl_in], [], [], max(0.0, deadline - time.monotonic()))[0]:
                    self.read_ctl()
            return []  # read_ctl killed it if it came
        return proctree.kill_tree(self.guard) if self.guard is not None else []


class Relay:
    def __init__(self, upstream: socket.socket, daemon: socket.socket, guardian: Guardian, *,
                 idle_timeout_s: float) -> None:
        self.up, self.dn, self.g = upstream, daemon, guardian
        self.idle_timeout_s = idle_timeout_s
        self.frames = _Frames()
        self.bytes = 0

    def run(self) -> dict[str, object]:
        buf = bytearray(1 << 20)
        mv = memoryview(buf)
        g = self.g
        last_up = time.monotonic()
        while g.failure is None:
            watch: list[Any] = [self.up, self.dn] + ([g.ctl_in] if g.ctl_open else [])
            ready = select.select(watch, [], [], min(1.0, self.idle_timeout_s))[0]
            now = time.monotonic()
            if g.ctl_in in ready:
                g.read_ctl()
            if self.dn in ready:
                data = self.dn.recv(1 << 16)
                if not data:  # the daemon is done (or died: then the kernel has its uffd, nothing left to guard)
                    break
                was_waiting = self.frames.outstanding
                try:
                    self.frames.from_daemon(data)
                except ValueError as e:
                    g.failure = str(e)
                    break
                if not was_waiting:
                    last_up = now  # the wait for a reply starts now
                try:
                    self.up.sendall(data)
                except OSError as e:
                    g.failure = f"the source's page server cannot be reached any more: {e}"
                    break
            if self.up in ready:
                try:
                    n = self.up.recv_into(mv)
                except OSError as e:
                    g.failure = (f"the source's page server hung up after {self.frames.pages} pages, "
                                    f"before the fill was done ({e.strerror or e})")
                    break
                if n == 0:
                    if self.frames.closed and not self.frames.outstanding:
                        break  # the source said goodbye after the daemon's close: a clean end
                    g.failure = (f"the source's page server hung up after {self.frames.pages} pages, "
                                    "before the fill was done")
                    break
                last_up = now
                try:
                    self.frames.from_source(mv[:n])
                except ValueError as e:
                    g.failure = str(e)
                    break
                self.bytes += n
                try:
                    self.dn.sendall(mv[:n])
                except OSError:
                    break  # the daemon is gone; its exit status tells the agent why
            if self.frames.outstanding and now - last_up > self.idle_timeout_s:
                g.failure = (f"the source's page server sent nothing for {self.idle_timeout_s:g} s while "
                                f"a request was outstanding ({self.frames.pages} pages had arrived)")
        mv.release()
        killed = g.settle()
        self.dn.close()  # only now may the daemon go, and the kernel drop the userfaultfd
        self.up.close()
        return {"ok": g.failure is None, "reason": g.failure or "", "bytes": self.bytes,
                "pages": self.frames.pages, "killed": killed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pitstop.memory.page_relay", description=__doc__.split("\n")[0])
    ap.add_argument("--upstream-fd", type=int, required=True, help="connected socket to the source's page server")
    a = daemon_side_args(ap).parse_args(argv)
    up = socket.socket(fileno=a.upstream_fd)
    dn = socket.socket(fileno=a.daemon_fd)
    up.setblocking(True)
    dn.setblocking(True)
    if up.family in (socket.AF_INET, socket.AF_INET6):
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the daemon waits on each request
    relay = Relay(up, dn, Guardian(sys.stdin.fileno(), sys.stdout, a.guard_timeout), idle_timeout_s=a.idle_timeout)
    return report(relay.run(), a.result_file)


def daemon_side_args(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments of whoever answers the daemon (this relay, or memory/local_pages.py)."""
    ap.add_argument("--daemon-fd", type=int, required=True, help="our end of the daemon's socketpair")
    ap.add_argument("--idle-timeout", type=float, default=60.0)
    ap.add_argument("--guard-timeout", type=float, default=60.0, help="how long to wait for the pid to guard")
    ap.add_argument("--result-file", type=Path, help="also write the result here, for an agent that restarted "
                                                     "while the fill ran (its pipe to us is gone)")
    return ap


def report(result: dict[str, object], result_file: Path | None) -> int:
    """The verdict: one JSON line to the agent, and to `result_file` for an agent that restarted."""
    if result_file is not None:
        try:
            tmp = result_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(result))
            os.replace(tmp, result_file)
        except OSError as e:
            print(f"could not write {result_file}: {e}", file=sys.stderr)
    try:
        print(json.dumps(result), flush=True)
    except OSError:
        pass
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

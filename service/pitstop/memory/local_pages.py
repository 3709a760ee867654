"""Serve a lazy restore's pages from this host's own files: a delta and its pre-copy.

Why a page server at all on the destination: CRIU's lazy-pages daemon cannot read a parent
image (memory/lazydelta.py says why), but it can ask a page server, and pitstop already speaks
that protocol (memory/page_server.py).  So the daemon gets one end of a socketpair and this
process answers it from the files the index names, with sendfile: one copy, page cache to socket.

Why a process of its own and not a thread of the agent: the worker depends on it until the fill
ends, and the agent may restart meanwhile (the agent places it in the worker's fill scope).  It
keeps the relay's contract with the agent (memory/page_relay.py, Guardian): `guard <pid>` on
stdin, `ok` back; if serving fails, the worker's tree is killed *before* the daemon's socket
closes, so no page is ever read as zero; one JSON verdict line at the end.  It opens every file
it serves at start: their directories count as in use for an agent that restarts meanwhile.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import sys
import threading
from pathlib import Path

from pitstop.memory import lazydelta
from pitstop.memory.page_relay import Guardian, daemon_side_args, report
from pitstop.memory.page_server import ProtocolError, Served, serve


def run(daemon: socket.socket, index: Path, guardian: Guardian, *, idle_timeout_s: float) -> dict[str, object]:
    split = lazydelta.read_index(index)
    held = [os.open(f, os.O_RDONLY) for t in split.tasks.values() for f in t.files]
    served: list[Served] = []
    failure: list[str] = []

    def answer() -> None:
        try:
            served.append(serve(daemon, split, idle_timeout_s=idle_timeout_s))
        except (ProtocolError, OSError, TimeoutError) as e:
            failure.append(f"the local page server failed: {e}")

    t = threading.Thread(target=answer, name="local-pages", daemon=True)
    t.start()
    try:
        while t.is_alive():  # the agent's control pipe, until serving ends
            if not guardian.ctl_open:
                t.join(0.2)
            elif select.select([guardian.ctl_in], [], [], 0.2)[0]:
                guardian.read_ctl()
        guardian.failure = failure[0] if failure else None
        killed = guardian.settle()
    finally:
        daemon.close()  # only now may the daemon go, and the kernel drop the userfaultfd
        for fd in held:
            os.close(fd)
    s = served[0] if served else Served()
    return {"ok": not failure, "reason": guardian.failure or "", "bytes": s.pages * 4096, "pages": s.pages,
            "killed": killed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pitstop.memory.local_pages", description=__doc__.split("\n")[0])
    ap.add_argument("--index", type=Path, required=True, help="where each lazy page lies (memory/lazydelta.py)")
    a = daemon_side_args(ap).parse_args(argv)
    dn = socket.socket(fileno=a.daemon_fd)
    dn.setblocking(True)
    result = run(dn, a.index, Guardian(sys.stdin.fileno(), sys.stdout, a.guard_timeout),
                 idle_timeout_s=a.idle_timeout)
    return report(result, a.result_file)


if __name__ == "__main__":
    raise SystemExit(main())

"""What CRIU lock tables that nobody lifted cost a later dump, inside its frozen window.

    .venv/bin/python bench/lock_tables.py [--left 0,24] [--conns 1,8] [--repeats 3] [--out bench/out/lock-tables.json]

A dump with --tcp-established adds an nftables table `CRIU-<run id>` that drops the dumped
connections' packets, and CRIU leaves it for whoever restores them.  pitstop lifts its own
(criu/netlock.py: commit, rollback, agent start); a table from another CRIU user, or from an
agent whose state was wiped, stays, and `pitstop doctor` names it.  This measures why that
matters: a process holding C loopback connections is dumped (CRIU's own frozen_time, from its
stats) while L tables left by earlier real dumps sit in the ruleset.  Leftovers are made the way
they arise: real dumps of processes holding a connection, killed without their tables lifted.
Every table and process this makes is removed at the end, also when it fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine  # noqa: E402
from pitstop.criu import criu_ops, netlock, runtime  # noqa: E402

HOLDER = """
import socket, sys, time
conns = [socket.create_connection(("127.0.0.1", int(sys.argv[1]))) for _ in range(int(sys.argv[2]))]
print("ready", flush=True)
time.sleep(600)
"""


class Listener:
    """Accepts and holds every connection made to it, so that each is ESTABLISHED at both ends."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(c)


def holder(port: int, conns: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(port), str(conns)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
                         start_new_session=True)  # CRIU dumps a session leader without --shell-job
    assert p.stdout.readline().strip() == "ready"
    return p


def dump_one(port: int, conns: int, work: Path, n: int, lift: bool) -> float:
    """Dump a holder of `conns` connections; its frozen time (s).  Its table is lifted unless
    `lift` is false (a leftover in the making)."""
    p = holder(port, conns)
    images = work / f"d{n}"
    try:
        r = criu_ops.dump(p.pid, images, criu_ops.DumpOptions(timeout_s=60, log_level=2))
        if lift:
            netlock.release(r.run_id)
        return r.frozen_s
    finally:
        p.kill()
        p.wait(30)
        shutil.rmtree(images, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--left", default="0,24", help="leftover CRIU tables, comma-separated")
    ap.add_argument("--conns", default="1,8", help="connections of the dumped process, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/out/lock-tables.json")
    a = ap.parse_args()
    rt = runtime.locate()
    if not rt.nft:
        raise SystemExit("nft not found: CRIU's nftables lock is what this measures")
    before = set(netlock.tables(rt))
    if before:
        print(f"note: {len(before)} CRIU tables were there already; they count as leftovers too")
    lefts = sorted(int(x) for x in a.left.split(","))
    conns = [int(x) for x in a.conns.split(",")]
    lst = Listener()
    work = Path(tempfile.mkdtemp(prefix="pitstop-locktables-"))
    runs: list[dict] = []
    n = 0
    try:
        for left in lefts:  # leftovers only grow, so the levels run in order, repeats inside
            while len(set(netlock.tables(rt)) - before) < left:
                dump_one(lst.port, 1, work, n, lift=False)
                n += 1
            for rep in range(a.repeats):
                for c in (conns if rep % 2 == 0 else conns[::-1]):
                    frozen = dump_one(lst.port, c, work, n, lift=True)
                    n += 1
                    runs.append({"left": left, "conns": c, "frozen_s": round(frozen, 4)})
                    print(runs[-1], flush=True)
    finally:
        for family, name in set(netlock.tables(rt)) - before:
            subprocess.run([rt.nft, "delete", "table", family, name], capture_output=True, timeout=30)
        shutil.rmtree(work, ignore_errors=True)
        lst.sock.close()
        for c in lst.held:
            c.close()
    med = {(l, c): statistics.median(r["frozen_s"] for r in runs if r["left"] == l and r["conns"] == c)
           for l in lefts for c in conns}
    summary: dict[str, float] = {f"{l} left, {c} conns: frozen s": round(v, 4) for (l, c), v in med.items()}
    if len(conns) > 1:
        lo, hi = min(conns), max(conns)
        for l in lefts:
            summary[f"{l} left: frozen s per connection"] = round((med[(l, hi)] - med[(l, lo)]) / (hi - lo), 4)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                       "machine": machine(), "command": " ".join(sys.argv),
                                       "criu": rt.version_str, "summary": summary, "runs": runs}, indent=1))
    for k, v in summary.items():
        print(f"{k}: {v}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

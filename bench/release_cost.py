"""What the release costs as the source grows: waiting for its exit against letting it go.

    .venv/bin/python bench/release_cost.py [--gib 0.75,1.5,3] [--repeats 3] [--out bench/out/release-cost.json]

The release kills the stopped source so that a restore of its connections on the same kernel
finds their addresses free.  A killed process closes its sockets only after its memory is
freed, so waiting for the exit costs time in proportion to the source's memory; let_go
(proc/proctree.py) frees the sockets first and lets the memory go in the background.
Each run: a process of N GiB of touched memory holding a TCP connection, stopped as a dump
leaves it (sockets in repair mode); the time until a socket can be bound to its four-tuple, by each way, interleaved.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine  # noqa: E402
from pitstop.proc import proctree  # noqa: E402

SOURCE = """
import mmap, socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
m = mmap.mmap(-1, int(float(sys.argv[2]) * (1 << 30)))
for i in range(0, len(m), 4096): m[i] = 1
print(s.getsockname()[1], flush=True)
sys.stdin.read()
"""


def _free(local: int, peer: int) -> bool:
    """Whether the source's four-tuple can be taken as CRIU's restore takes it."""
    s = socket.socket()
    try:
        s.setsockopt(socket.IPPROTO_TCP, 19, 1)  # TCP_REPAIR: forces port reuse; the four-tuple decides
        s.bind(("127.0.0.1", local))
        s.connect(("127.0.0.1", peer))
        return True
    except OSError:
        return False
    finally:
        s.close()


def one(gib: float, how: str) -> float:
    ls = socket.create_server(("127.0.0.1", 0))
    p = subprocess.Popen([sys.executable, "-c", SOURCE, str(ls.getsockname()[1]), str(gib)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ours, _ = ls.accept()
    local = int(p.stdout.readline())
    proctree.stop([p.pid])
    while proctree.state(p.pid) != "T":
        time.sleep(0.001)
    proctree.silence_tcp([p.pid])  # as CRIU's dump leaves a source: its sockets in repair mode
    peer = ls.getsockname()[1]
    t0 = time.perf_counter()
    if how == "wait":
        assert proctree.kill_and_wait(p.pid)
    else:
        assert proctree.let_go(p.pid) is None
    dt = time.perf_counter() - t0
    assert _free(local, peer), f"{how}: the four-tuple is still held"
    p.wait(30)
    ours.close()
    ls.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", default="0.75,1.5,3", help="the source's memory, GiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/out/release-cost.json")
    a = ap.parse_args()
    runs = []
    for i in range(a.repeats):
        for gib in (float(x) for x in a.gib.split(",")):
            for how in (("wait", "let_go") if i % 2 == 0 else ("let_go", "wait")):
                runs.append({"gib": gib, "how": how, "seconds": round(one(gib, how), 4)})
                print(runs[-1], flush=True)
    summary = {f"{g} GiB, {h}": statistics.median(r["seconds"] for r in runs if r["gib"] == g and r["how"] == h)
               for g in sorted({r["gib"] for r in runs}) for h in ("wait", "let_go")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                       "machine": machine(), "command": " ".join(sys.argv),
                                       "summary": summary, "runs": runs}, indent=1))
    for k, v in summary.items():
        print(f"{k}: {v:.4f} s")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

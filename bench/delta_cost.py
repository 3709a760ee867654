"""The pre-copy's delta, on its own: the kernel's write tracking against page digests, in one run.

A torch process holding STATE MiB trains a small model between a pre-copy and a CRIU dump (as a
rank does); then the delta is written against the pre-copy.  Each round does it both ways on
the same process, interleaved: digests (every page of the dump hashed with xxh3-128) and write
tracking (memory/writetrack.py: the kernel lists what was written).  The figure that matters is
the delta's time, which the whole job waits for; the bytes that changed must come out alike.

    .venv/bin/python bench/delta_cost.py [--state-mb 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "service"))
sys.path.insert(0, str(ROOT))

from bench.common import machine  # noqa: E402
from pitstop.criu import criu_ops, netlock
from pitstop.memory import precopy, writetrack
from pitstop.proc import proctree  # noqa: E402

HOLDER = r"""
import sys, time, torch
torch.set_num_threads(1)
state = torch.ones(int(sys.argv[1]) << 18)  # MiB of float32
m = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.Adam(m.parameters())
print("ready", flush=True); sys.stdout.close()
while True:
    x = torch.randn(64, 512)
    loss = m(x).square().mean(); opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.01)
"""


def one(root: int, work: Path, track: bool) -> dict:
    pre, images, view = work / "pre", work / "images", work / "view"
    pre.mkdir()
    t0 = time.monotonic()
    basis = precopy.snapshot("bench", proctree.tree(root), pre, track=track)
    pre_s = time.monotonic() - t0
    time.sleep(1.0)  # it trains: Adam's state, the gradients and Python's heap change
    run_id = criu_ops.dump(root, images).run_id
    try:
        d = precopy.rewrite(images, view, basis, end_tracking=False)
        t1 = time.monotonic()
        basis.close()  # what a live process's close costs (the agent does it after the source exits)
        close_s = time.monotonic() - t1
    finally:
        proctree.resume(proctree.tree(root))  # CRIU left it stopped; let it train on
        netlock.release(run_id)
    dump_bytes = sum(f.stat().st_size for f in images.glob("pages-*.img"))
    shutil.rmtree(pre)
    shutil.rmtree(images)
    shutil.rmtree(view)
    return {"track": track, "delta_s": round(d.seconds, 4), "close_s": round(close_s, 4),
            "pre_copy_s": round(pre_s, 3), "pre_copy_bytes": basis.bytes, "dump_bytes": dump_bytes,
            "changed_bytes": d.changed_bytes, "parent_bytes": d.parent_bytes,
            "tracked_tasks": d.tracked_tasks, "digested_tasks": d.digested_tasks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--state-mb", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "delta-cost.json")
    a = ap.parse_args()
    why = writetrack.unavailable()
    if why:
        raise SystemExit(f"write tracking is unavailable here ({why}): nothing to compare")
    lib = ROOT / "native" / "build" / writetrack.LIBRARY
    if not lib.exists():
        raise SystemExit(f"{lib} is not built: run `make native`")
    env = dict(os.environ, LD_PRELOAD=str(lib), OMP_NUM_THREADS="1")
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, "-c", HOLDER, str(a.state_mb)],
                         stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env)
    work = Path(tempfile.mkdtemp(prefix="delta-cost-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    runs = []
    try:
        if p.stdout.readline().strip() != b"ready":
            raise SystemExit("the holder did not start")
        root = proctree.children(p.pid)[0]
        for i in range(a.rounds):
            for track in ((True, False) if i % 2 == 0 else (False, True)):
                r = one(root, work, track)
                runs.append(r)
                print(json.dumps(r), flush=True)
    finally:
        for q in reversed(proctree.tree(p.pid)):
            try:
                os.kill(q, 9)
            except OSError:
                pass
        p.wait(10)
        shutil.rmtree(work, ignore_errors=True)

    def med(track: bool, k: str) -> float:
        return statistics.median(r[k] for r in runs if r["track"] == track)

    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "state_mb": a.state_mb, "rounds": a.rounds,
               "delta_s_tracked": med(True, "delta_s"), "delta_s_digests": med(False, "delta_s"),
               "changed_bytes_tracked": med(True, "changed_bytes"), "changed_bytes_digests": med(False, "changed_bytes"),
               "close_s_live": med(True, "close_s"),
               "pre_copy_bytes_tracked": med(True, "pre_copy_bytes"), "pre_copy_bytes_digests": med(False, "pre_copy_bytes"),
               "dump_bytes_tracked": med(True, "dump_bytes"), "dump_bytes_digests": med(False, "dump_bytes"),
               "pre_copy_s_tracked": med(True, "pre_copy_s"), "pre_copy_s_digests": med(False, "pre_copy_s")}
    summary["speedup"] = round(summary["delta_s_digests"] / summary["delta_s_tracked"], 2)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

"""What each of the patches pitstop carries to CRIU does, on a process tree like a rank's with its
DataLoader workers, against the stock CRIU, in one run.

    .venv/bin/python bench/criu_patches.py --criu stock=PATH --criu carried=PATH [--criu NAME=PATH ...]
        [--workload torch|synthetic] [--mib 512] [--children 2] [--repeats 3]

Each CRIU named dumps and restores the same tree.  `torch` (the default): a PyTorch process with
MIB MiB of state and a DataLoader with CHILDREN persistent worker processes that has produced 20
batches; after the restore it checks its state's digest and that the next batch is the one that
follows.  `synthetic`: a parent whose MIB MiB each have their own bytes, CHILDREN forked children
that write 2 % of the pages after the fork, and the parent 5 %; every process checks its memory's
digest.  For each run: the dump's time and image bytes, the restore's time (`criu restore -d`,
until the tree runs), the tree's PSS (anonymous memory) before the dump and after the restore, and
the checks.  The CRIUs run interleaved; the medians
are reported.  Builds with part of the series come from scripts/build-criu.sh with
PITSTOP_CRIU_SERIES naming a shorter series file (docs/benchmarks.md says which).  Root only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
TREE = r"""
import hashlib, mmap, os, signal, sys
N, KIDS = int(sys.argv[3]) << 20, int(sys.argv[4])
m = mmap.mmap(-1, N, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for i in range(0, N, 4096):
    m[i:i + 8] = i.to_bytes(8, "little")
go = []
signal.signal(signal.SIGUSR1, lambda *_: go.append(1))
def check(name, digest):
    while not go:
        signal.pause()
    with open(sys.argv[2], "a") as f:
        f.write(f"{name} {'ok' if hashlib.sha256(m).hexdigest() == digest else 'bad'}\n")
r, w = os.pipe()
kids = []
for k in range(KIDS):
    pid = os.fork()
    if pid == 0:
        for i in range(k * 4096, N, 50 * 4096):  # 2 % of the pages
            m[i + 8] = 0xee
        d = hashlib.sha256(m).hexdigest()
        os.write(w, b"k")
        check(f"child{k}", d)
        os._exit(0)
    kids.append(pid)
for i in range(0, N, 20 * 4096):  # 5 %
    m[i + 16] = 0xaa
d = hashlib.sha256(m).hexdigest()
got = b""
while len(got) < KIDS:
    got += os.read(r, KIDS)
open(sys.argv[1], "w").close()
while not go:
    signal.pause()
for k in kids:
    os.kill(k, signal.SIGUSR1)
for k in kids:
    os.waitpid(k, 0)
check("parent", d)
"""


TORCH = r"""
import hashlib, signal, sys, torch
MIB, KIDS = int(sys.argv[3]), int(sys.argv[4])
state = torch.arange(MIB * 262144, dtype=torch.int32)
class Items(torch.utils.data.Dataset):
    def __len__(self):
        return 10 ** 6
    def __getitem__(self, i):
        return torch.full((32,), float(i))
batches = iter(torch.utils.data.DataLoader(Items(), batch_size=16, num_workers=KIDS, persistent_workers=True))
for _ in range(20):
    next(batches)
d = hashlib.sha256(state.numpy().tobytes()).hexdigest()
go = []
signal.signal(signal.SIGUSR1, lambda *_: go.append(1))
open(sys.argv[1], "w").close()
while not go:
    signal.pause()
ok = hashlib.sha256(state.numpy().tobytes()).hexdigest() == d and next(batches)[:, 0].tolist() == list(range(320, 336))
with open(sys.argv[2], "a") as f:
    f.write(f"parent {'ok' if ok else 'bad'}\n")
"""


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _pss_mib(pids: list[int]) -> float:
    """The tree's anonymous memory, each shared page counted once over its sharers (file pages
    left out: a restored process has not faulted its libraries in yet)."""
    kib = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss_Anon:"):
                kib += int(line.split()[1])
    return kib / 1024


def _kill(pids: list[int]) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one(name: str, criu: str, mib: int, kids: int, work: Path, workload: str) -> dict:
    d = work / f"{name}-{time.monotonic_ns()}"
    imgs = d / "images"
    imgs.mkdir(parents=True)
    ready, results = d / "ready", d / "results"
    holder = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, "-c",
                               TORCH if workload == "torch" else TREE, str(ready),
                               str(results), str(mib), str(kids)], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    restored: list[int] = []
    try:
        end = time.monotonic() + 300
        while not ready.exists():  # (a torch tree's DataLoader workers have made batches by then)
            if holder.poll() is not None or time.monotonic() > end:
                raise SystemExit("the tree did not start")
            time.sleep(0.05)
        (root,) = _children(holder.pid)
        tree = [root, *_children(root)]
        pss_before = _pss_mib(tree)
        t0 = time.monotonic()
        p = subprocess.run([criu, "dump", "-t", str(root), "-D", str(imgs), "-o", "dump.log", "-v2"],
                           capture_output=True, text=True, timeout=600)
        dump_s = time.monotonic() - t0
        if p.returncode:
            raise SystemExit(f"{name}: dump failed, see {imgs / 'dump.log'}")
        image_bytes = sum(f.stat().st_size for f in imgs.glob("pages-*.img"))
        t0 = time.monotonic()
        p = subprocess.run([criu, "restore", "-D", str(imgs), "-d", "--pidfile", str(d / "pid"), "-o", "restore.log",
                            "-v2"], capture_output=True, text=True, timeout=600)
        restore_s = time.monotonic() - t0
        if p.returncode:
            raise SystemExit(f"{name}: restore failed, see {imgs / 'restore.log'}")
        top = int((d / "pid").read_text().split()[0])
        restored = [top, *_children(top)]
        pss_after = _pss_mib(restored)
        os.kill(top, signal.SIGUSR1)
        end = time.monotonic() + 120
        while "parent" not in (results.read_text() if results.exists() else ""):
            if time.monotonic() > end:
                raise SystemExit(f"{name}: the restored tree did not report")
            time.sleep(0.05)
        ok = all(line.endswith(" ok") for line in results.read_text().split("\n") if line)
        return {"criu": name, "dump_s": round(dump_s, 3), "image_mib": round(image_bytes / 2**20, 1),
                "restore_s": round(restore_s, 3), "pss_before_mib": round(pss_before, 1),
                "pss_after_mib": round(pss_after, 1), "bitwise": ok}
    finally:
        _kill(restored)
        _kill([*(_children(holder.pid) if holder.poll() is None else []), holder.pid])
        holder.wait(30)
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--criu", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--workload", choices=["torch", "synthetic"], default="torch")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--children", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(OUT / "criu-patches.json"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("CRIU needs root")
    criu = dict(c.split("=", 1) for c in a.criu)
    work = Path(tempfile.mkdtemp(prefix="pitstop-criu-patches-", dir="/run" if Path("/run").is_dir() else None))
    runs = []
    try:
        for _ in range(a.repeats):
            for name, path in criu.items():
                runs.append(one(name, path, a.mib, a.children, work, a.workload))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = ("dump_s", "image_mib", "restore_s", "pss_before_mib", "pss_after_mib")
    medians = {name: {k: statistics.median(r[k] for r in runs if r["criu"] == name) for k in keys}
               for name in criu}
    for name in criu:
        medians[name]["bitwise"] = all(r["bitwise"] for r in runs if r["criu"] == name)
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv),
           "workload": a.workload, "mib": a.mib, "children": a.children, "medians": medians, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"{machine()}; {a.workload}: a parent of {a.mib} MiB and {a.children} children; medians of {a.repeats}")
    print(f"{'CRIU':<24}{'dump s':>8}{'images MiB':>12}{'restore s':>11}{'PSS before':>12}{'PSS after':>11}  bitwise")
    for name, m in medians.items():
        print(f"{name:<24}{m['dump_s']:>8.3f}{m['image_mib']:>12.1f}{m['restore_s']:>11.3f}"
              f"{m['pss_before_mib']:>12.1f}{m['pss_after_mib']:>11.1f}  {m['bitwise']}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""Compression of the image stream against the link it crosses (issue 7: "use compression only where it wins").

Real images: a CRIU dump of a rank of the reference job (tests/workloads/ddp_train.py, one rank,
gloo), taken mid-training, once per kind of state the rank holds: none beyond torch's own memory,
512 MiB of int32 counting up (the benches' usual ballast), 512 MiB of normal float32 (like weights).
Each image directory is streamed with the code every move uses (DirectoryTail, the data port,
digests and manifest check at both ends) into a host in a network namespace of its own, whose
link is slowed with a token bucket (NetHosts.shape) to 1, 2.5 and 10 Gbit/s, or left as this
machine's veth and bridge allow.  Per link and image set, interleaved, each of:

  off            every piece raw (pitstop before compression; the baseline)
  on             every piece that shrinks compressed (zstd level 1)
  auto, first    the default, on its first stream to that destination: it learns as it goes
  auto, learned  the default again, on a stream that follows one to the same destination (as the
                 pause's delta follows the pre-copy)

reports the rate (raw image bytes per second, send to the receiver's verified manifest) and the
bytes on the wire.  What "where it wins" means here: auto should be within a few percent of the
better of off and on at every link, without being told which.

Run as root: `.venv/bin/python bench/compress_link.py [--repeats 3] [--links 1000,2500,10000,0]`.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, stop_by_stdin  # noqa: E402
from bench.stream_rate import _mount, _umount  # noqa: E402
from pitstop.criu import runtime  # noqa: E402
from pitstop.dev.devcluster import wait_for_step  # noqa: E402
from pitstop.dev.netns import NetHosts  # noqa: E402
from pitstop.launcher.seccomp import deny_io_uring  # noqa: E402
from pitstop.transfer import compress, dataport  # noqa: E402
from pitstop.transfer.compress import Compression, Link  # noqa: E402
from pitstop.transfer.manifest import Manifest  # noqa: E402
from pitstop.transfer.stream import DirectoryTail  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).resolve().parent / "out"
WORKLOAD = ROOT / "tests" / "workloads" / "ddp_train.py"

RECEIVER = r"""
import shutil, sys
from pathlib import Path
from types import SimpleNamespace
from pitstop.transfer.dataport import DataPort
from pitstop.transfer.stream import StreamReceiver, verify_directory
dest = Path(sys.argv[1])
def open_slot(image_id):
    return SimpleNamespace(image_id=image_id, receiver=StreamReceiver(dest / image_id))
def finished(slot):
    m = verify_directory(dest / slot.image_id)  # every file against the sender's digests
    shutil.rmtree(dest / slot.image_id)
    return {"bytes": m.total_bytes}
port = DataPort(sys.argv[2], 0, token="bench", open_slot=open_slot, fail_slot=lambda s: None, finished=finished,
                on_error=lambda slot, e: e).start()
print(port.port, flush=True)
sys.stdin.readline()
port.close()
"""

IMAGE_SETS = {  # name -> ddp_train arguments
    "rank alone": [],
    "rank + 512 MiB arange": ["--state-mb", "512", "--state-kind", "arange"],
    "rank + 512 MiB randn": ["--state-mb", "512", "--state-kind", "randn"],
}


def dump_rank(args: list[str], dest: Path, work: Path, port: int) -> int:
    """A CRIU dump of one training rank, mid-training, into `dest`; its image bytes."""
    work.mkdir(parents=True, exist_ok=True)
    log = work / "rank.log"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "2"}
    p = subprocess.Popen(["unshare", "--pid", "--fork", "setsid", sys.executable, str(WORKLOAD), "--steps", "2000",
                          "--out", str(work / "out"), *args], env=env, stdin=subprocess.DEVNULL,
                         stdout=log.open("w"), stderr=subprocess.STDOUT, preexec_fn=deny_io_uring)
    try:
        wait_for_step(log, 20, timeout_s=180)
        pid = int(subprocess.check_output(["pgrep", "-P", str(p.pid)]).split()[0])
        dest.mkdir(parents=True)
        r = subprocess.run([runtime.locate().binary, "dump", "-t", str(pid), "-D", str(dest), "-o", "dump.log",
                            "--shell-job", "--tcp-established", "--network-lock", "nftables"],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"criu dump failed: {(dest / 'dump.log').read_text()[-2000:]}")
        (dest / "dump.log").unlink()
        return sum(f.stat().st_size for f in dest.iterdir())
    finally:
        p.kill()
        p.wait()


def stream(src: Path, addr: str, port: int, image_id: str, c: Compression) -> dict:
    tail = DirectoryTail(src, compression=c)
    tail.manifest_base = Manifest(capture_id=image_id)
    tail.finished.set()
    t0 = time.perf_counter()
    reply = dataport.send(iter(tail), addr, port, image_id, "bench", timeout_s=600, compression=c)
    dt = time.perf_counter() - t0
    return {"seconds": dt, "bytes": reply["bytes"], "gbps": reply["bytes"] / dt / 1e9, **c.summary()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--links", default="1000,2500,10000,0", help="Mbit/s of the slowed link; 0: not slowed")
    ap.add_argument("--sets", default=",".join(IMAGE_SETS), help="which image sets (comma-separated names)")
    ap.add_argument("--out", default=str(OUT / "compress_link.json"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/compress_link.py dumps with CRIU and makes network namespaces: run it as root")
    links = [int(x) for x in a.links.split(",")]
    sets = [s for s in a.sets.split(",") if s]
    root = Path(tempfile.mkdtemp(prefix="pitstop-compress-bench-"))
    srcfs, destfs = root / "src", root / "dest"
    net = NetHosts()
    rx = None
    results: list[dict] = []
    sizes: dict[str, int] = {}
    try:
        _mount(srcfs)
        _mount(destfs)
        for i, name in enumerate(sets):
            sizes[name] = dump_rank(IMAGE_SETS[name], srcfs / f"set{i}", root / f"work{i}", 29700 + i)
            print(f"dumped {name}: {sizes[name] / 1e6:.0f} MB", flush=True)
        _, addr = net.add("spare")
        env = {**os.environ, "PYTHONPATH": str(ROOT / "service")}
        rx = subprocess.Popen([*net.exec_prefix("spare"), sys.executable, "-c", RECEIVER, str(destfs), addr],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        port = int(rx.stdout.readline())  # type: ignore[union-attr]
        n = 0
        for mbit in links:
            net.shape("spare", mbit or None)
            for i, name in enumerate(sets):
                src = srcfs / f"set{i}"
                stream(src, addr, port, f"warm-{n}", Compression("off"))  # the receiver's memory, the link's queue
                n += 1
                for rep in range(a.repeats):
                    learned = Link()
                    methods = [("off", lambda: Compression("off")), ("on", lambda: Compression("on")),
                               ("auto, first", lambda: Compression("auto", link=learned)),
                               ("auto, learned", lambda: Compression("auto", link=learned))]
                    order = methods[rep % 2:] + methods[:rep % 2]  # off and on take turns going first
                    if order[0][0] == "auto, learned":
                        order = order[1:] + order[:1]
                    for method, c in order:
                        r = stream(src, addr, port, f"s{n}", c())
                        n += 1
                        results.append({"link_mbit": mbit, "images": name, "method": method, "repeat": rep, **r})
                        print(f"{mbit or 'unshaped':>8} {name:30s} {method:14s} {r['gbps']:6.3f} GB/s "
                              f"wire {r['wire_bytes'] / max(1, r['raw_bytes']):.2f} "
                              f"compressed {r['compressed_pieces']}/{r['pieces']}", flush=True)
        table = []
        for mbit in links:
            for name in sets:
                row = {"link_mbit": mbit, "images": name, "image_bytes": sizes[name]}
                for method in ("off", "on", "auto, first", "auto, learned"):
                    rs = [r for r in results if r["link_mbit"] == mbit and r["images"] == name and r["method"] == method]
                    row[method] = {"gbps": statistics.median(r["gbps"] for r in rs),
                                   "wire_share": statistics.median(r["wire_bytes"] / max(1, r["raw_bytes"]) for r in rs),
                                   "compressed_share": statistics.median(r["compressed_pieces"] / max(1, r["pieces"])
                                                                         for r in rs)}
                best = max(row["off"]["gbps"], row["on"]["gbps"])
                row["auto_learned_vs_best"] = row["auto, learned"]["gbps"] / best
                row["auto_first_vs_best"] = row["auto, first"]["gbps"] / best
                table.append(row)
        out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "command": " ".join([Path(sys.executable).name, *sys.argv]), "repeats": a.repeats,
               "zstd_level": 1, "zstd_threads": compress.default_threads(), "table": table, "runs": results}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(f"\nmedians of {a.repeats}; GB/s of image bytes (share of the bytes on the wire)")
        print(f"{'link':>9} {'images':30s} {'off':>12} {'on':>12} {'auto, first':>12} {'auto, learned':>14}  auto/best")
        for row in table:
            cells = [f"{row[m]['gbps']:5.3f} ({row[m]['wire_share']:.2f})" for m in ("off", "on", "auto, first", "auto, learned")]
            print(f"{(str(row['link_mbit']) + ' Mb/s') if row['link_mbit'] else 'unshaped':>9} {row['images']:30s} "
                  f"{cells[0]:>12} {cells[1]:>12} {cells[2]:>12} {cells[3]:>14}  "
                  f"{row['auto_first_vs_best']:.2f} / {row['auto_learned_vs_best']:.2f}")
        print(f"written to {a.out}")
    finally:
        stop_by_stdin(rx)
        net.close()
        _umount(srcfs)
        _umount(destfs)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

"""pitstop's image stream against raw TCP, on its own (issue 7: "transfer at least 80 % of raw TCP").

Why a bench of its own: compare.py's stream figure (bytes over the stop-and-copy's transfer
phase) times the stream *while CRIU writes the images*, so it measures CRIU's dump as much as
the transport.  This one moves a finished image directory between two processes with the code
every move uses (DirectoryTail -> dataport.send -> DataPort -> StreamReceiver: framing, read-ahead,
xxh3 on both ends, the manifest check) and, in the same run, interleaved:

  raw TCP           a buffer sent and discarded (bench/common.py's floor, what compare.py uses)
  file to file      the same bytes from a file on one tmpfs into a file on another with
                    sendfile() and recv_into() + pwrite(): no framing, no digests.  The least a
                    transfer that lands in memory can cost on this machine.
  pitstop stream    the image directory through the data port, into the same kind of tmpfs.

Each end's CPU seconds are recorded for every method: on this VM the rate moves with the memory
the host has taken back, CPU per byte much less, and the difference in CPU between the stream and
raw TCP is what the stream costs beyond moving bytes.

Both tmpfs are mounted for the run the way the agent mounts its image directory
(huge=within_size, agent/imagefs.py), so the destination's memory is what a move writes to.
Run as root: `.venv/bin/python bench/stream_rate.py [--mib 768] [--repeats 5] [--pin 0:1]`.
`--pin SENDER:RECEIVER` binds each end, for every method alike, to its own CPUs (lists such as
`0`, `2-3`): on a machine with cores to spare that measures the transport the way two agents on
two hosts run it, a core or a few each, instead of both ends sharing two cores as on the test VM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import machine, parse_cpus, pinned_to, raw_tcp_bandwidth, stop_by_stdin  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"

FILE_RECEIVER = r"""
import os, socket, sys
path = sys.argv[1]
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(4 << 20); mv = memoryview(buf); n = 0
import time; c0 = time.process_time()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
while True:
    k = c.recv_into(mv)
    if not k: break
    os.pwrite(fd, mv[:k], n)
    n += k
os.close(fd)
print(n, time.process_time() - c0, flush=True)
"""

STREAM_RECEIVER = r"""
import sys, threading, time
from pathlib import Path
from types import SimpleNamespace
from pitstop.transfer.dataport import DataPort
from pitstop.transfer.stream import StreamReceiver
dest = Path(sys.argv[1])
done = threading.Event()
def open_slot(image_id):
    return SimpleNamespace(image_id=image_id, receiver=StreamReceiver(dest / image_id), cpu0=time.process_time())
def finished(slot):
    done.set()
    return {"bytes": slot.receiver.received, "receiver_cpu_s": time.process_time() - slot.cpu0}
def fail_slot(slot):
    done.set()
port = DataPort("127.0.0.1", 0, token=None, open_slot=open_slot, fail_slot=fail_slot, finished=finished,
                on_error=lambda slot, e: e).start()
print(port.port, flush=True)
sys.stdin.readline()  # the parent says when to stop
port.close()
"""


def _mount(where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8g,huge=within_size,mode=0700", "tmpfs", str(where)],
                   check=True)


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], check=False)


def make_images(src: Path, mib: int) -> int:
    """An image directory shaped like one rank's: one big pages file, a few small ones.  The pages
    are not all equal (a constant buffer would flatter nothing here, but real pages are not)."""
    src.mkdir(parents=True, exist_ok=True)
    block = bytearray(os.urandom(1 << 20))
    with open(src / "pages-1.img", "wb") as f:
        for i in range(mib):
            block[:8] = i.to_bytes(8, "little")
            f.write(block)
    for name, size in (("pagemap-1.img", 64 << 10), ("mm-1.img", 12 << 10), ("core-1.img", 3 << 10),
                       ("files.img", 2 << 10), ("inventory.img", 100)):
        (src / name).write_bytes(os.urandom(size))
    return sum(p.stat().st_size for p in src.iterdir())


def file_to_file(src_file: Path, dest_file: Path, cpu: dict[str, float],
                 receiver_cpus: set[int] | None = None) -> float:
    """sendfile() from `src_file`, recv_into() + pwrite() into `dest_file`; bytes/s (each end's
    CPU seconds into `cpu`)."""
    p = subprocess.Popen([sys.executable, "-c", FILE_RECEIVER, str(dest_file)], stdout=subprocess.PIPE, text=True,
                         preexec_fn=pinned_to(receiver_cpus))
    try:
        port = int(p.stdout.readline())  # type: ignore[union-attr]
        size = src_file.stat().st_size
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        s.settimeout(None)  # sendfile() on a socket with a timeout would return EAGAIN
        fd = os.open(src_file, os.O_RDONLY)
        c0 = time.process_time()
        t0 = time.perf_counter()
        off = 0
        while off < size:
            off += os.sendfile(s.fileno(), fd, off, size - off)
        s.shutdown(socket.SHUT_WR)
        cpu["sender"] = time.process_time() - c0
        got_s, rx_cpu = p.stdout.readline().split()  # type: ignore[union-attr]
        got, cpu["receiver"] = int(got_s), float(rx_cpu)
        dt = time.perf_counter() - t0
        os.close(fd)
        s.close()
        assert got == size, (got, size)
        return size / dt
    finally:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        dest_file.unlink(missing_ok=True)


def pitstop_stream(src: Path, port: int, image_id: str, dest: Path, cpu: dict[str, float] | None = None) -> float:
    """The image directory through the data port, as a move sends it; bytes/s (each end's CPU
    seconds into `cpu`, the sender's with its read-ahead thread)."""
    from pitstop.transfer import dataport
    from pitstop.transfer.manifest import Manifest
    from pitstop.transfer.stream import DirectoryTail

    tail = DirectoryTail(src)
    tail.manifest_base = Manifest(capture_id=image_id)
    tail.finished.set()
    c0 = time.process_time()
    t0 = time.perf_counter()
    reply = dataport.send(iter(tail), "127.0.0.1", port, image_id, None, timeout_s=60)
    dt = time.perf_counter() - t0
    if cpu is not None:
        cpu.update(sender=time.process_time() - c0, receiver=reply["receiver_cpu_s"])
    got = dest / image_id
    n = sum(p.stat().st_size for p in got.iterdir() if p.name != "pitstop-manifest.json")
    shutil.rmtree(got)
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=768, help="size of the big pages file (one rank: about 770 MB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(OUT / "stream_rate.json"))
    ap.add_argument("--pin", default=None, metavar="SENDER:RECEIVER",
                    help="CPUs for each end, e.g. 0:1 or 0-1:2-3 (default: unpinned)")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/stream_rate.py mounts two tmpfs: run it as root")
    send_cpus = recv_cpus = None
    if a.pin:
        send_text, sep, recv_text = a.pin.partition(":")
        if not sep:
            raise SystemExit(f"--pin {a.pin!r}: expected SENDER:RECEIVER, e.g. 0:1")
        send_cpus, recv_cpus = parse_cpus(send_text), parse_cpus(recv_text)
        if send_cpus & recv_cpus:
            raise SystemExit(f"--pin {a.pin!r}: the two ends share CPUs {sorted(send_cpus & recv_cpus)}; "
                             "give each its own")
        os.sched_setaffinity(0, send_cpus)  # this process sends, its read-ahead thread too
    root = Path(tempfile.mkdtemp(prefix="pitstop-stream-bench-"))
    srcfs, destfs = root / "src", root / "dest"
    rx = None
    try:
        _mount(srcfs)
        _mount(destfs)
        images = srcfs / "images"
        total = make_images(images, a.mib)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "service")}
        rx = subprocess.Popen([sys.executable, "-c", STREAM_RECEIVER, str(destfs)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, preexec_fn=pinned_to(recv_cpus))
        port = int(rx.stdout.readline())  # type: ignore[union-attr]
        pitstop_stream(images, port, "warm-up", destfs)  # first touch of the destination's memory
        runs: dict[str, list[float]] = {"raw TCP": [], "file to file": [], "pitstop stream": []}
        cpu: dict[str, dict[str, list[float]]] = {k: {"sender": [], "receiver": []} for k in runs}
        for i in range(a.repeats):  # interleaved: a slow spell hits every method
            for method, run in (("raw TCP", lambda c: raw_tcp_bandwidth(total, cpu=c, receiver_cpus=recv_cpus)),
                                ("file to file", lambda c: file_to_file(images / "pages-1.img", destfs / "plain.img", c,
                                                                        recv_cpus)),
                                ("pitstop stream", lambda c: pitstop_stream(images, port, f"run-{i}", destfs, c))):
                c: dict[str, float] = {}
                runs[method].append(run(c))
                for end, seconds in c.items():
                    cpu[method][end].append(seconds)
        med = {k: statistics.median(v) for k, v in runs.items()}
        cpu_med = {k: {end: statistics.median(v) for end, v in c.items()} for k, c in cpu.items()}
        result = {
            "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "pinned": {"sender": sorted(send_cpus), "receiver": sorted(recv_cpus)} if send_cpus and recv_cpus else None,
            "bytes": total, "repeats": a.repeats, "bytes_per_s": runs, "median_bytes_per_s": med,
            "stream_vs_raw_tcp": med["pitstop stream"] / med["raw TCP"],
            "stream_vs_file_to_file": med["pitstop stream"] / med["file to file"],
            "file_to_file_vs_raw_tcp": med["file to file"] / med["raw TCP"],
            "stream_vs_raw_tcp_per_run": [s / r for s, r in zip(runs["pitstop stream"], runs["raw TCP"])],
            "cpu_s": cpu, "median_cpu_s": cpu_med,
        }
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
        print(f"{total / 1e6:.0f} MB per run, {a.repeats} runs each, interleaved; GB/s, median [min-max]")
        for k, v in runs.items():
            print(f"  {k:15s} {med[k] / 1e9:5.2f} [{min(v) / 1e9:.2f}-{max(v) / 1e9:.2f}]")
        print("  CPU seconds per run, median (sender / receiver):")
        for k, c in cpu_med.items():
            print(f"    {k:15s} {c['sender']:.3f} / {c['receiver']:.3f}")
        print(f"  pitstop stream / raw TCP      {result['stream_vs_raw_tcp']:.0%} "
              f"(median of the per-run ratios {statistics.median(result['stream_vs_raw_tcp_per_run']):.0%})")
        print(f"  pitstop stream / file to file {result['stream_vs_file_to_file']:.0%}")
        print(f"written to {a.out}")
    finally:
        stop_by_stdin(rx)
        _umount(srcfs)
        _umount(destfs)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

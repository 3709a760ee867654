"""Shared bench pieces: the raw TCP floor between two local endpoints, the job's own pause."""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

from pitstop.dev.devcluster import step_gaps, step_times

RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(4 << 20); n = 0; c0 = time.process_time()
while True:
    k = c.recv_into(buf)
    if not k: break
    n += k
print(n, time.process_time() - c0, flush=True)
"""


def until(pred: Callable[[], object], timeout: float, what: str = "condition", every: float = 0.1):  # noqa: ANN201
    """Poll `pred` until it returns something true (returned), or raise TimeoutError(what)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = pred()
        if got:
            return got
        time.sleep(every)
    raise TimeoutError(f"{what}: not within {timeout:g} s")


def pinned_to(cpus: set[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` that binds a child, and every thread it will start, to `cpus` (None: as the
    parent is).  Set before exec rather than after the spawn: a mask set from outside reaches only
    the main thread, not threads the child has already started."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def parse_cpus(text: str) -> set[int]:
    """'0', '0-3' or '0,2,4-5' as a set of CPU numbers; a clear error for anything else."""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise SystemExit(f"CPU list {text!r}: expected numbers and ranges such as 0 or 2-3 or 0,4-5")
        out.update(range(int(lo), int(hi or lo) + 1))
    bad = out - os.sched_getaffinity(0)
    if bad:
        raise SystemExit(f"CPU list {text!r}: CPUs {sorted(bad)} are not available here "
                         f"(this process may use {sorted(os.sched_getaffinity(0))})")
    return out


def raw_tcp_bandwidth(nbytes: int = 1 << 30, cpu: dict[str, float] | None = None,
                      receiver_cpus: set[int] | None = None) -> float:
    """Bytes/s of a plain TCP copy between two processes over loopback: the transfer floor.
    `cpu`, if given, gets each end's CPU seconds ("sender", "receiver"): on this VM the rate moves
    with the host's memory, CPU per byte much less, so it shows where a transfer's cost goes.
    `receiver_cpus` pins the receiving process (the sender is this process, as pinned)."""
    p = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True,
                         preexec_fn=pinned_to(receiver_cpus))
    port = int(p.stdout.readline())
    data = memoryview(bytearray(b"\x5a" * (4 << 20)))
    s = socket.create_connection(("127.0.0.1", port))
    c0 = time.process_time()
    t0 = time.perf_counter()
    sent = 0
    while sent < nbytes:
        s.sendall(data)
        sent += len(data)
    s.shutdown(socket.SHUT_WR)
    sender_cpu = time.process_time() - c0
    got_s, rx_cpu = p.stdout.readline().split()
    got = int(got_s)
    dt = time.perf_counter() - t0
    if cpu is not None:
        cpu.update(sender=sender_cpu, receiver=float(rx_cpu))
    s.close()
    p.wait()
    assert got == sent
    return sent / dt


def evacuate_and_wait(cc: "object", node: str, label: str = "evacuation", pre_copy: bool | None = None) -> dict:
    """Evacuate `node` through the coordinator and wait for the operation; its metadata."""
    op = cc.evacuate(node, pre_copy=pre_copy)  # type: ignore[attr-defined]
    while not op["done"]:
        time.sleep(0.05)
        op = cc.op(op["name"])  # type: ignore[attr-defined]
    md = op["metadata"]
    if md["result"] != "succeeded":
        raise SystemExit(f"{label}: evacuation failed: {op.get('error')}")
    return md


def prewarm(gib: float) -> float:
    """Touch `gib` of tmpfs and free it at once; seconds taken.  This VM backs guest memory lazily
    and takes freed memory back (free page reporting), so the first write to memory costs up to
    ten times a later one.  Every method pays it; pre-warming shows the steady state instead."""
    if gib <= 0:
        return 0.0
    t0 = time.perf_counter()
    path = Path("/dev/shm") / f"pitstop-prewarm-{os.getpid()}"
    block = b"\x5a" * (16 << 20)
    # At the job's priority, 8 busy ranks on 2 cores left the prewarm a ninth of the CPU: 76-81 s
    # for 4 GiB (2026-12-03 13:20), long enough for the job to end before the move.  At nice -10
    # it takes its share; what it warms is the same.
    tid = threading.get_native_id()
    nice = os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, -10)
    except PermissionError:
        pass
    try:
        with open(path, "wb") as f:
            for _ in range(int(gib * 64)):
                f.write(block)
    finally:
        path.unlink(missing_ok=True)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except PermissionError:
            pass
    return time.perf_counter() - t0


REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")


def host_reclaimed_kib() -> int | None:
    """Guest memory handed back to the host so far (free page reporting), where this VM's kernel
    counts it; None elsewhere.  Memory handed back in 2 MiB blocks is slow to touch again: on
    this VM a huge page faults in at 8 GB/s warm and 0.4-0.8 GB/s once reported (docs/benchmarks.md),
    so a run during which much was reported met cold memory."""
    try:
        return int(REPORTED_KIB.read_text())
    except (OSError, ValueError):
        return None


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time of a process itself, and of the children it has reaped (an agent; its CRIU runs)."""
    f = [int(x) / os.sysconf("SC_CLK_TCK") for x in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:15]]
    return f[0] + f[1], f[2] + f[3]


def job_pause(log: Path, since: float = 0.0) -> tuple[float, float]:
    """(longest gap between steps after `since`, median gap): the pause as the job saw it, and a normal step."""
    gaps = sorted(step_gaps(log, since))
    return (gaps[-1], gaps[len(gaps) // 2]) if gaps else (0.0, 0.0)


def machine() -> str:
    cpu = "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Linux {platform.release()}"


def first_divergent_step(logs: list[Path]) -> int | None:
    """The first step after which the ranks' parameters differ (ddp_train --trace-params), or None."""
    per = [dict(re.findall(r"^params (\d+) (\w+)", p.read_text(errors="replace"), re.M)) for p in logs]
    steps = sorted(set().union(*per), key=int)
    return next((int(s) for s in steps if len({d.get(s) for d in per}) > 1), None)


def moved_after_step(log: Path, since: float) -> int | None:
    """The step before the longest gap after `since`: where the job was paused."""
    ts = [t for t in step_times(log) if t[1] >= since]
    if len(ts) < 2:
        return None
    return max(((ts[i + 1][1] - ts[i][1], ts[i][0]) for i in range(len(ts) - 1)))[1]


def keep_logs(root: Path, dest: Path) -> Path:
    """Copy every log under a cluster's root, and the ranks' step-1 traces (ddp_train
    --trace-params: parameters and gradients after the first update), to `dest` (same layout)
    before the cluster is removed."""
    for f in list(root.rglob("*.log")) + list(root.rglob("trace-rank*-step1.pt")):  # listed first: dest may lie under root
        (dest / f.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest / f.relative_to(root))
    return dest


def stop_by_stdin(p: "subprocess.Popen | None") -> None:
    """End a helper process that runs until its standard input closes (the benches' receivers);
    killed if it does not end within 10 s."""
    if p is None:
        return
    try:
        p.stdin.close()  # type: ignore[union-attr]
        p.wait(timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        p.kill()
        p.wait()


def ab_parser(doc: str, worlds: str, out: Path) -> argparse.ArgumentParser:
    """The arguments every interleaved A/B bench takes: pairs per size, sizes, state, result file."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=3, help="pairs per job size")
    ap.add_argument("--worlds", default=worlds, help="job sizes, comma-separated")
    ap.add_argument("--state-mb", type=float, default=512.0)
    ap.add_argument("--out", default=str(out))
    return ap


def ab_run(r: dict) -> dict:
    """What every A/B bench keeps of one measured move (bench/compare.py's evacuation result),
    the bitwise checks included: a run whose ranks disagree is no evidence for either arm."""
    return {"world": r["world"], "downtime_s": r["downtime_s"], "job_pause_s": r["job_pause_s"],
            "phases": r["phases"], "prewarm_s": r["prewarm_s"], "ranks_agree": r["first_divergent_step"] is None,
            "final_hashes_equal": len(set(r["final"])) == 1}


def ab_summary(runs: list[dict], arm: str, worlds: list[int], modes: list[str],
               medians: dict[str, Callable[[dict], Iterable[float]]]) -> dict:
    """An A/B bench's medians per job size and arm: each named figure over what its getter takes
    from every run of that cell (one value or several, such as one per leaving rank)."""
    import statistics

    out = {}
    for world in worlds:
        for mode in modes:
            rs = [x for x in runs if x["world"] == world and x[arm] == mode]
            out[f"{world} ranks, {arm} {mode}"] = {name: statistics.median(v for x in rs for v in get(x))
                                                   for name, get in medians.items()}
    return out


def write_ab(out: Path, summary: dict, runs: list) -> None:
    """An A/B bench's result: its medians per arm and every run, with date, machine and command."""
    import json
    import sys
    import time

    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
                               "command": " ".join(sys.argv), "summary": summary, "runs": runs}, indent=1))
    for k, v in summary.items():
        print(k, {m: round(x, 3) for m, x in v.items()})
    print(f"wrote {out}")

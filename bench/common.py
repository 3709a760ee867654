"""Shared bench pieces: the raw TCP floor between two local endpoints, the job's own pause."""

from __future__ import annotations

import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

RECEIVER = r"""
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(4 << 20); n = 0
while True:
    k = c.recv_into(buf)
    if not k: break
    n += k
print(n, flush=True)
"""


def raw_tcp_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a plain TCP copy between two processes over loopback: the transfer floor."""
    p = subprocess.Popen([sys.executable, "-c", RECEIVER], stdout=subprocess.PIPE, text=True)
    port = int(p.stdout.readline())
    data = memoryview(bytearray(b"\x5a" * (4 << 20)))
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    sent = 0
    while sent < nbytes:
        s.sendall(data)
        sent += len(data)
    s.shutdown(socket.SHUT_WR)
    got = int(p.stdout.readline())
    dt = time.perf_counter() - t0
    s.close()
    p.wait()
    assert got == sent
    return sent / dt


def step_gaps(log: Path) -> list[tuple[int, float]]:
    """(step, seconds since the previous step) for every step line of the workload."""
    times = [(int(m.group(1)), float(m.group(2))) for m in
             re.finditer(r"^step (\d+) t=([0-9.]+)", log.read_text(errors="replace"), re.M)]
    return [(s, t - tp) for (s, t), (_, tp) in zip(times[1:], times[:-1])]


def job_pause(log: Path, since: float = 0.0) -> tuple[float, float]:
    """(longest gap between steps after `since`, median gap): the pause as the job saw it, and a normal step."""
    times = [float(m.group(1)) for m in re.finditer(r"^step \d+ t=([0-9.]+)", log.read_text(errors="replace"), re.M)]
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if b >= since)
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

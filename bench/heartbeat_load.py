"""Control plane at fleet scale: simulated agents heartbeating against one real coordinator.

Each simulated agent holds one keep-alive HTTP connection and posts a realistic heartbeat
(its name, URL, 8 GPUs' readings, 8 workers) at --rate Hz with jitter; latency is measured
per request from send to the end of the response.  The load generators are separate
processes (raw sockets and hand-made HTTP/1.1, so that the client costs as little as
possible); they share this machine's cores with the coordinator, so the figures are a
lower bound for the coordinator on a machine of its own.  Reports requests/s achieved,
p50/p99/max latency and the coordinator's CPU use; writes bench/out/heartbeat_load.json.

    .venv/bin/python bench/heartbeat_load.py --agents 10000 --rate 1 --seconds 30 --procs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine  # noqa: E402
from pitstop.devcluster import LocalCluster  # noqa: E402


def payload(i: int) -> bytes:
    gpus = [{"index": g, "uuid": f"GPU-{i:08x}-0000-0000-0000-{g:012x}", "temperature_c": 50 + g,
             "memory_used": 10**10, "memory_total": 1.4e11, "ecc_uncorrected_volatile": 0,
             "retired_pages": 0, "remap_pending": False, "throttle_reasons": []} for g in range(8)]
    workers = [{"id": f"job{i // 4}.{i % 4 * 8 + w}", "job": f"job{i // 4}", "rank": i % 4 * 8 + w,
                "state": "running", "root_pid": 1000 + w} for w in range(8)]
    return json.dumps({"name": f"gpu-{i:05d}", "url": f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:7070",
                       "workers": workers, "gpus": [{"index": g, "uuid": gpus[g]["uuid"], "name": "NVIDIA H200"}
                                                      for g in range(8)],
                       "gpu_model": "NVIDIA H200", "gpu_count": 8, "gpu_health": gpus}).encode()


async def agent(i: int, host: str, port: int, token: str, rate: float, until: float, lat: list[float],
                errors: list[str]) -> None:
    body = payload(i)
    req = (f"POST /v1/agents:heartbeat HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {token}\r\n"
           f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body
    await asyncio.sleep(random.random() / rate)
    reader = writer = None
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            if writer is None:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
            writer.write(req)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(n), 10)
            if not head.startswith(b"HTTP/1.1 200"):
                errors.append(head.split(b"\r\n")[0].decode())
            lat.append(time.monotonic() - t0)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            errors.append(type(e).__name__)
            writer = None
        await asyncio.sleep(max(0.0, 1 / rate - (time.monotonic() - t0)) * random.uniform(0.9, 1.1))


def generator(ids: range, host: str, port: int, token: str, rate: float, until: float, q: mp.Queue) -> None:
    lat: list[float] = []
    errors: list[str] = []

    async def main() -> None:
        await asyncio.gather(*(agent(i, host, port, token, rate, until, lat, errors) for i in ids))

    asyncio.run(main())
    q.put((lat, errors))


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=10000)
    ap.add_argument("--rate", type=float, default=1.0, help="heartbeats per agent per second")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--procs", type=int, default=2, help="load generator processes")
    a = ap.parse_args()
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if a.agents + 64 > hard:
        raise SystemExit(f"{a.agents} agents need {a.agents + 64} open files; the limit here is {hard}")
    with LocalCluster(root=Path(tempfile.mkdtemp(prefix="pitstop-hb-"))) as c:
        url = c.start_coordinator()
        host, port = url.split("//")[1].split(":")
        pid = c.coordinator_proc.pid
        warm = time.monotonic() + 5
        until = warm + a.seconds
        q: mp.Queue = mp.Queue()
        chunks = [range(k, a.agents, a.procs) for k in range(a.procs)]
        ps = [mp.Process(target=generator, args=(ids, host, int(port), c.token, a.rate, until, q)) for ids in chunks]
        for p in ps:
            p.start()
        time.sleep(max(0.0, warm - time.monotonic()))
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        time.sleep(max(0.0, until - time.monotonic()))
        cpu1, t1 = cpu_seconds(pid), time.monotonic()
        lat: list[float] = []
        errors: list[str] = []
        for _ in ps:
            lt, er = q.get(timeout=120)
            lat += lt
            errors += er
        for p in ps:
            p.join(30)
    lat.sort()
    pct = (lambda x: lat[min(len(lat) - 1, int(x * len(lat)))] * 1000) if lat else (lambda x: float("nan"))
    res = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv),
           "agents": a.agents, "rate_hz": a.rate, "offered_per_s": a.agents * a.rate,
           "achieved_per_s": round(len(lat) / (a.seconds + 5), 1), "p50_ms": round(pct(0.5), 2),
           "p99_ms": round(pct(0.99), 2), "max_ms": round(lat[-1] * 1000, 2) if lat else None,
           "errors": len(errors), "error_kinds": sorted(set(errors))[:5],
           "coordinator_cpu_cores": round((cpu1 - cpu0) / (t1 - t0), 2)}
    Path("bench/out").mkdir(parents=True, exist_ok=True)
    Path("bench/out/heartbeat_load.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

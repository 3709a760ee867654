"""Control plane at fleet scale: simulated agents heartbeating against one real coordinator.

Each simulated agent holds one keep-alive HTTP connection and speaks the agents' protocol
(agent/heartbeat.py): one full report (its name, URL, 8 GPUs' readings, 8 workers), then a
beat at --rate Hz with jitter, a full report again whenever the coordinator answers 409;
--full-only sends the full report every time (the protocol before beats).  Agents start
spread over --ramp-s (a fleet does not boot in one second); latency is measured per
request from send to the end of the response, after the ramp only.  The load generators are separate
processes (raw sockets and hand-made HTTP/1.1, so that the client costs as little as
possible); they share this machine's cores with the coordinator, so the figures are a
lower bound for the coordinator on a machine of its own.  Reports requests/s achieved,
p50/p99/max latency and the coordinator's CPU use; writes bench/out/heartbeat_load.json.

--db both (the default) runs the same load twice in one run, the coordinator on SQLite, then on a
private PostgreSQL (pitstop.dev.devpostgres, durable: fsync and synchronous commit on, as a real
install), and reports both, with the PostgreSQL server's own CPU use.

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
from pitstop.dev.devcluster import LocalCluster  # noqa: E402
from pitstop.wire.beats import ACK_OK, big_buffers, decode_ack, encode_beat  # noqa: E402


def payload(i: int, generation: str) -> bytes:
    gpus = [{"index": g, "uuid": f"GPU-{i:08x}-0000-0000-0000-{g:012x}", "temperature_c": 50 + g,
             "memory_used": 10**10, "memory_total": 1.4e11, "ecc_uncorrected_volatile": 0,
             "retired_pages": 0, "remap_pending": False, "throttle_reasons": []} for g in range(8)]
    workers = [{"id": f"job{i // 4}.{i % 4 * 8 + w}", "job": f"job{i // 4}", "rank": i % 4 * 8 + w,
                "state": "running", "root_pid": 1000 + w} for w in range(8)]
    return json.dumps({"name": f"gpu-{i:05d}", "url": f"http://10.{i // 65536}.{i // 256 % 256}.{i % 256}:7070",
                       "workers": workers, "gpus": [{"index": g, "uuid": gpus[g]["uuid"], "name": "NVIDIA H200"}
                                                      for g in range(8)],
                       "gpu_model": "NVIDIA H200", "gpu_count": 8, "gpu_health": gpus,
                       "generation": generation}).encode()


def _post(host: str, token: str, path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {token}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


class Acks(asyncio.DatagramProtocol):
    def __init__(self, key: bytes) -> None:
        self.key = key
        self.waiting: dict[int, asyncio.Future] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        big_buffers(transport.get_extra_info("socket"))

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        a = decode_ack(self.key, data)
        fut = self.waiting.pop(a[0], None) if a else None
        if fut is not None and not fut.done():
            fut.set_result(a[1])


async def agent(i: int, host: str, port: int, token: str, rate: float, ramp: float, measure_from: float,
                until: float, full_only: bool, lat: list[float], errors: list[str], kinds: dict[str, int],
                udp: tuple[asyncio.DatagramTransport, Acks] | None = None) -> None:
    gen = f"sim{i}-1"
    full = _post(host, token, "/v1/agents:heartbeat", payload(i, gen))
    beat = full if full_only else _post(host, token, "/v1/agents:beat",
                                        json.dumps({"name": f"gpu-{i:05d}", "generation": gen}).encode())
    need_full = True
    k = 0
    await asyncio.sleep(random.random() * ramp)
    reader = writer = None
    while time.monotonic() < until:
        t0 = time.monotonic()
        try:
            if udp is not None and not need_full:  # the beat as a datagram, answered by an ack
                transport, acks = udp
                k += 1
                seq = (k << 20) | i
                fut = asyncio.get_running_loop().create_future()
                acks.waiting[seq] = fut
                transport.sendto(encode_beat(token.encode(), seq, f"gpu-{i:05d}", gen, time.time()))
                try:
                    status = await asyncio.wait_for(fut, 2.0)
                except asyncio.TimeoutError:
                    acks.waiting.pop(seq, None)
                    if t0 >= measure_from:
                        errors.append("udp timeout")
                else:
                    need_full = status != ACK_OK
                    if t0 >= measure_from:
                        lat.append(time.monotonic() - t0)
                        kinds["beat_udp"] = kinds.get("beat_udp", 0) + 1
                await asyncio.sleep(max(0.0, 1 / rate - (time.monotonic() - t0)) * random.uniform(0.9, 1.1))
                continue
            if writer is None:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
            writer.write(full if need_full else beat)
            kind = "full" if need_full or full_only else "beat"
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(n), 10)
            if head.startswith(b"HTTP/1.1 409"):
                need_full = True  # the coordinator asks for a full report
                continue
            if not head.startswith(b"HTTP/1.1 200"):
                if t0 >= measure_from:
                    errors.append(head.split(b"\r\n")[0].decode())
            else:
                need_full = False
            if t0 >= measure_from:
                lat.append(time.monotonic() - t0)
                kinds[kind] = kinds.get(kind, 0) + 1
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            if t0 >= measure_from:  # errors of the measured window only, like the latencies
                errors.append(type(e).__name__)
            writer = None
        await asyncio.sleep(max(0.0, 1 / rate - (time.monotonic() - t0)) * random.uniform(0.9, 1.1))


def generator(ids: range, host: str, port: int, token: str, rate: float, ramp: float, measure_from: float,
              until: float, full_only: bool, use_udp: bool, q: mp.Queue) -> None:
    lat: list[float] = []
    errors: list[str] = []
    kinds: dict[str, int] = {}

    async def main() -> None:
        udp = None
        if use_udp:
            udp = await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: Acks(token.encode()), remote_addr=(host, port))
        await asyncio.gather(*(agent(i, host, port, token, rate, ramp, measure_from, until, full_only, lat, errors,
                                     kinds, udp) for i in ids))

    asyncio.run(main())
    q.put((lat, errors, kinds))


def cpu_seconds(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def session_cpu_seconds(sid: int) -> float:
    """CPU seconds of every live process of a session (a PostgreSQL server: its postmaster and backends)."""
    total = 0.0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            f = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[3]) == sid:
            total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return total


# Every simulated agent connects from this machine's one address: the coordinator's cap on the
# connections of one source (128, against a flood from one host) would refuse all but the first
# 128 agents' full reports, which a fleet of hosts with their own addresses never meets.
ONE_SOURCE = {"PITSTOP_COORDINATOR_MAX_CONNECTIONS_PER_SOURCE": "20000"}


def run(a: argparse.Namespace, db: str) -> dict:
    """The load against one coordinator on `db` (sqlite or postgresql); its figures."""
    pg = None
    with LocalCluster(root=Path(tempfile.mkdtemp(prefix="pitstop-hb-"))) as c:
        try:
            if db == "postgresql":
                from pitstop.dev.devpostgres import PrivatePostgres

                pg = PrivatePostgres(durable=True)
                url = c.start_coordinators([pg.create_database()], envs=[ONE_SOURCE])[0].url
                pid = c.coordinators[0].proc.pid
            else:
                url = c.start_coordinator(env=ONE_SOURCE)
                assert c.coordinator_proc is not None
                pid = c.coordinator_proc.pid
            host, port = url.split("//")[1].split(":")
            warm = time.monotonic() + a.ramp_s + 5
            until = warm + a.seconds
            q: mp.Queue = mp.Queue()
            chunks = [range(k, a.agents, a.procs) for k in range(a.procs)]
            ps = [mp.Process(target=generator, args=(ids, host, int(port), c.token, a.rate, a.ramp_s, warm, until,
                                                     a.full_only, a.transport == "udp" and not a.full_only, q))
                  for ids in chunks]
            for p in ps:
                p.start()
            time.sleep(max(0.0, warm - time.monotonic()))
            cpu0, t0 = cpu_seconds(pid), time.monotonic()
            db0 = session_cpu_seconds(pg.proc.pid) if pg and pg.proc else 0.0
            time.sleep(max(0.0, until - time.monotonic()))
            cpu1, t1 = cpu_seconds(pid), time.monotonic()
            db1 = session_cpu_seconds(pg.proc.pid) if pg and pg.proc else 0.0
            lat: list[float] = []
            errors: list[str] = []
            kinds: dict[str, int] = {}
            for _ in ps:
                lt, er, kd = q.get(timeout=120)
                lat += lt
                errors += er
                for k, v in kd.items():
                    kinds[k] = kinds.get(k, 0) + v
            for p in ps:
                p.join(30)
        finally:
            for co in c.coordinators:  # before its database goes
                if co.proc.poll() is None:
                    co.proc.terminate()
                    co.proc.wait(30)
            if pg is not None:
                pg.close()
    lat.sort()
    pct = (lambda x: lat[min(len(lat) - 1, int(x * len(lat)))] * 1000) if lat else (lambda x: float("nan"))
    return {"database": db, "measured_by_kind": kinds,
            "achieved_per_s": round(len(lat) / a.seconds, 1), "p50_ms": round(pct(0.5), 2),
            "p99_ms": round(pct(0.99), 2), "max_ms": round(lat[-1] * 1000, 2) if lat else None,
            "errors": len(errors), "error_kinds": sorted(set(errors))[:5],
            "coordinator_cpu_cores": round((cpu1 - cpu0) / (t1 - t0), 2),
            **({"database_server_cpu_cores": round((db1 - db0) / (t1 - t0), 2)} if pg else {})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=10000)
    ap.add_argument("--rate", type=float, default=1.0, help="heartbeats per agent per second")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--procs", type=int, default=2, help="load generator processes")
    ap.add_argument("--ramp-s", type=float, default=30.0, help="agents start spread over this long (not measured)")
    ap.add_argument("--full-only", action="store_true", help="every heartbeat a full report (no beats)")
    ap.add_argument("--transport", choices=("udp", "http"), default="udp",
                    help="how beats travel (full reports always go over HTTP)")
    ap.add_argument("--db", choices=("both", "sqlite", "postgresql"), default="both",
                    help="the coordinator's database; both: the same load on each, one after the other")
    a = ap.parse_args()
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if a.agents + 64 > hard:
        raise SystemExit(f"{a.agents} agents need {a.agents + 64} open files; the limit here is {hard}")
    runs = [run(a, db) for db in (("sqlite", "postgresql") if a.db == "both" else (a.db,))]
    res = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv),
           "agents": a.agents, "rate_hz": a.rate, "offered_per_s": a.agents * a.rate,
           "protocol": "full reports only" if a.full_only else f"beats over {a.transport} (full report on change)",
           **(runs[0] if len(runs) == 1 else {"runs": runs})}
    Path("bench/out").mkdir(parents=True, exist_ok=True)
    Path("bench/out/heartbeat_load.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

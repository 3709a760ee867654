"""Move one rank of a reference job between two agents; report every phase against the floor.

    make bench            (or: .venv/bin/python bench/move_one_rank.py --state-mb 512)

Prints each phase's time and bytes, the raw TCP bandwidth between the two
endpoints measured in the same run, the data floor (bytes / bandwidth), and
downtime / floor.  Writes bench/out/move_one_rank.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import cpu_seconds, job_pause, machine, prewarm, raw_tcp_bandwidth  # noqa: E402
from pitstop.dev.devcluster import LocalCluster, wait_for_step  # noqa: E402
from pitstop.migration.move import move_worker  # noqa: E402

WORKLOAD = Path(__file__).resolve().parent.parent / "tests" / "workloads" / "ddp_train.py"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-mb", type=float, default=512.0, help="extra state in the moved rank (MiB)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=1,
                    help="moves before the measured one (this VM pays a large first-touch cost for fresh "
                         "memory; warm-up moves measure the steady state, and are reported too)")
    ap.add_argument("--tls", action="store_true", help="mutual TLS between the agents (the stream's TLS cost)")
    ap.add_argument("--post-copy", action="store_true",
                    help="network post-copy: only the pages a restore must place travel before it")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader worker processes per rank (a tree to move)")
    ap.add_argument("--agent-env", action="append", default=[], metavar="NAME=VALUE",
                    help="agent setting for both agents, e.g. PITSTOP_AGENT_LAZY_RESTORE=1 or "
                         "PITSTOP_AGENT_DEDUP_PAGES=0 (repeatable)")
    ap.add_argument("--prewarm-gib", type=float, default=0.0,
                    help="touch and free this much tmpfs right before the measured move (bench/common.py prewarm)")
    ap.add_argument("--keep-logs", metavar="DIR", help="copy the agents' and ranks' logs here before the cluster goes")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "move_one_rank.json"))
    args = ap.parse_args()

    bw = raw_tcp_bandwidth()
    with LocalCluster() as c:
        if args.tls:
            c.tls_dir = c.root / "pki"
            os.environ.update(c.tls_env("coordinator"))  # this process drives the agents, as the coordinator does
        env = dict(kv.split("=", 1) for kv in args.agent_env)
        a = c.start_agent("a", env=env)
        b = c.start_agent("b", spare=True, env=env)
        out = c.root / "out"
        cmd = [sys.executable, str(WORKLOAD), "--steps", str(args.steps), "--out", str(out),
               "--state-mb", str(args.state_mb), "--step-sleep", "0.05", "--workers", str(args.workers)]
        ranks = c.start_job("bench", cmd, 2, {0: "a", 1: "a"})
        c.wait_registered("a", "bench.1")
        wait_for_step(ranks[1].log, 20)
        warm = []
        hosts = [(a, b), (b, a)]
        for i in range(args.warmup):
            src, dst = hosts[i % 2]
            filled = dst.log.read_text(errors="replace").count("memory filled")
            warm.append(move_worker(src.client(), dst.client(), "bench.1", dest_name=dst.name,
                                    peers=[(a.client(), "bench.0")], post_copy=args.post_copy).downtime_s)
            time.sleep(1.0)
            if args.post_copy or "PITSTOP_AGENT_LAZY_RESTORE" in env:
                end = time.monotonic() + 120  # the next move would wait for this fill: not what it measures
                while dst.log.read_text(errors="replace").count("memory filled") == filled and time.monotonic() < end:
                    time.sleep(0.1)
        src, dst = hosts[args.warmup % 2]
        prewarm(args.prewarm_gib)
        mark = time.time()
        cpu0 = {n: cpu_seconds(x.proc.pid) for n, x in (("source", src), ("destination", dst))}
        rep = move_worker(src.client(), dst.client(), "bench.1", dest_name=dst.name, peers=[(a.client(), "bench.0")],
                          post_copy=args.post_copy)
        time.sleep(0.3)  # CRIU's processes are reaped, their time counted in their agent's
        cpu = {f"{n} {what}": round(cpu_seconds(x.proc.pid)[i] - cpu0[n][i], 3)
               for n, x in (("source", src), ("destination", dst)) for i, what in enumerate(("agent", "CRIU"))}
        cap = next(x for x in src.client().captures() if x.id == rep.capture_id)
        codes = [r.proc.wait(300) for r in ranks]
        # post-copy: the fill after the resume (the last "memory filled" line is the measured move's)
        fills = re.findall(r"memory filled\s+seconds=([0-9.]+)", dst.log.read_text(errors="replace"))
        fill_s = float(fills[-1]) if fills and (cap.post_copy or env.get("PITSTOP_AGENT_LAZY_RESTORE")) else None
        lazy_bytes = (cap.post_copy or {}).get("lazy_bytes")
        if args.keep_logs:
            for f in c.root.rglob("*"):
                if f.is_file() and f.suffix in (".log", ".stdout", ".stderr"):
                    dest = Path(args.keep_logs) / f.relative_to(c.root)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, dest)
        pause, step = job_pause(ranks[0].log, since=mark)
    floor = rep.bytes / bw
    res = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "state_mb": args.state_mb,
        "prewarm_gib": args.prewarm_gib,
        "tls": args.tls,
        "workers": args.workers,
        "agent_env": env,
        "bytes": rep.bytes,
        "bytes_deduplicated": cap.bytes_deduplicated,
        "compression": cap.compression,  # what the stream compressed (transfer/compress.py)
        "phases_s": {k: round(v, 4) for k, v in rep.phases.items()},
        "downtime_s": round(rep.downtime_s, 4),
        "warmup_downtimes_s": [round(x, 4) for x in warm],
        "job_pause_s": round(pause, 4),
        "normal_step_s": round(step, 4),
        "raw_tcp_bytes_per_s": round(bw),
        "floor_s": round(floor, 4),
        "downtime_over_floor": round(rep.downtime_s / floor, 2),
        "exit_codes": codes,
        "cpu_s": cpu,
        "fill_s": fill_s,
        "bytes_after_resume": lazy_bytes,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"moved {rep.bytes / 2**20:.0f} MiB of rank 1 ({res['machine']}){' over mutual TLS' if args.tls else ''}"
          f"{f', {args.workers} DataLoader workers' if args.workers else ''}{f', {env}' if env else ''}; "
          f"{res['bytes_deduplicated'] / 2**20:.0f} MiB of it sent as references")
    print(f"{'phase':<22}{'seconds':>10}")
    for k, v in rep.phases.items():
        print(f"{k:<22}{v:>10.3f}")
    print(f"{'downtime':<22}{rep.downtime_s:>10.3f}   (warm-up moves: {', '.join(f'{x:.3f}' for x in warm)})")
    print(f"{'pause seen by the job':<22}{pause:>10.3f}   (a normal step: {step:.3f} s)")
    print(f"raw TCP bandwidth      {bw / 1e9:.2f} GB/s   floor = bytes / bandwidth = {floor:.3f} s")
    print(f"downtime / floor       {rep.downtime_s / floor:.2f}")
    print(f"CPU                    {', '.join(f'{k} {v:.2f} s' for k, v in cpu.items())} "
          "(the job's own excluded)")
    if fill_s is not None:
        rate = f", {lazy_bytes / fill_s / 1e9:.2f} GB/s = {lazy_bytes / fill_s / bw:.0%} of raw TCP" if lazy_bytes else ""
        print(f"fill after the resume  {fill_s:.3f} s{rate}")
    print(f"job exit codes         {codes}")


if __name__ == "__main__":
    main()

"""A snapshot's pause for ranks with DataLoader worker processes against the same ranks without,
in one run, and the share of the job's time its snapshots take at one a minute.

Why: nearly every real training job forks loader workers, and a snapshot dumps the whole tree
of each rank.  Its pause must stay close to the same job's without workers (the goal: within
1.3 x), and the snapshots must stay incremental: only what changed since the last one.

The job: the test suite's 2-rank torch DDP job (gloo, each rank with its own address and
--state-mb of extra state), rank 0 on host-a, rank 1 on host-b, a spare; agents and coordinator
real.  For each arm (0 and --workers loader workers a rank) a snapshot every --every seconds is
taken for --window seconds (the interval not lengthened: PITSTOP_COORDINATOR_SNAPSHOT_PAUSE_SHARE=1);
the first --warmup snapshots (the job's start-up memory settling) are left out.  Reported per
arm: the pause of each delta snapshot and of each whole one (every 8th, CRIU's chain), their
bytes, and the share of time paused at one snapshot a minute: the mean pause over a chain of 8
(7 deltas and 1 whole) over 60 s.

Writes bench/out/snapshot_workers.json; prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine  # noqa: E402
from pitstop.dev.devcluster import LocalCluster, wait_for_step  # noqa: E402
from pitstop.dev.netns import NetHosts  # noqa: E402
from pitstop.wire.coordinator_client import CoordinatorClient  # noqa: E402
from tests.helpers import ddp_cmd  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
CHAIN = 8  # agent/snapshots.py CHAIN_MAX: a whole part after every 7 deltas


def arm(workers: int, state_mb: float, every: float, window: float, warmup: int) -> dict:
    os.environ["PITSTOP_COORDINATOR_SNAPSHOT_PAUSE_SHARE"] = "1"
    with LocalCluster() as cluster:
        cluster.net = NetHosts()
        cluster.start_coordinator()
        with cluster.starting():
            cluster.start_agent("host-a")
            cluster.start_agent("host-b")
            cluster.start_agent("spare-1", spare=True)
        cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
        out = cluster.root / "out"
        addrs = {r: cluster.worker_address(r) for r in range(2)}
        ranks = cluster.start_job("train", ddp_cmd(out, steps=20_000, workers=workers, state_mb=state_mb,
                                                   step_sleep=0.02), 2, {0: "host-a", 1: "host-b"},
                                  addresses=addrs, run_args=["--snapshot-every", str(every)])
        wait_for_step(ranks[1].log, 5, timeout_s=120)
        seen: dict[int, dict] = {}
        end = time.time() + window
        while time.time() < end:
            try:
                snaps = cc.snapshots("train")["snapshots"]
            except Exception as e:  # noqa: BLE001 - the job not registered yet
                print("not yet:", e, file=sys.stderr)
                snaps = []
            for s in snaps:
                if s["state"] == "committed" and s["number"] not in seen:
                    seen[s["number"]] = {"number": s["number"], "pause_s": s["pause_s"], "bytes": s.get("bytes", 0),
                                         "whole": not s.get("incremental"), "phases": s.get("phases", {}),
                                         "parts": {w: {"processes": p.get("processes"), "steps": p.get("steps", {})}
                                                   for w, p in (s.get("parts") or {}).items()}}
            time.sleep(0.2)
        last_error = cc.snapshots("train").get("last_error")
        for r in ranks:
            r.proc.terminate()
    if not seen:
        raise SystemExit(f"no snapshot committed in {window} s with {workers} workers: {last_error}")
    kept = [seen[n] for n in sorted(seen)][warmup:]
    deltas = [s["pause_s"] for s in kept if not s["whole"]]
    wholes = [s["pause_s"] for s in kept if s["whole"]]
    out_d: dict = {"workers": workers, "snapshots": kept, "left_out": [seen[n] for n in sorted(seen)][:warmup],
                   "last_error": last_error,
                   "delta_pause_s": statistics.median(deltas) if deltas else None,
                   "delta_bytes": statistics.median([s["bytes"] for s in kept if not s["whole"]]) if deltas else None,
                   "whole_pause_s": statistics.median(wholes) if wholes else None,
                   "whole_bytes": statistics.median([s["bytes"] for s in kept if s["whole"]]) if wholes else None}
    delta_kept = [s for s in kept if not s["whole"]]
    # where a delta's pause goes: the coordinator's phases, and the slowest part's agent steps
    out_d["delta_phases_s"] = _medians([s["phases"] for s in delta_kept])
    out_d["delta_part_steps_s"] = _medians([max(s["parts"].values(), key=lambda p: sum(p["steps"].values()))["steps"]
                                            for s in delta_kept if s["parts"]])
    if deltas:
        chain = ((CHAIN - 1) * out_d["delta_pause_s"] + (out_d["whole_pause_s"] or out_d["delta_pause_s"])) / CHAIN
        out_d["share_at_one_a_minute"] = chain / 60.0
    return out_d


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for r in rows for k in r})
    return {k: round(statistics.median([r[k] for r in rows if k in r]), 4) for k in keys}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="loader workers a rank in the second arm")
    p.add_argument("--state-mb", type=float, default=128.0)
    p.add_argument("--every", type=float, default=5.0)
    p.add_argument("--window", type=float, default=150.0, help="seconds of snapshots per arm")
    p.add_argument("--warmup", type=int, default=3, help="first snapshots left out (start-up memory)")
    a = p.parse_args()
    arms = [arm(w, a.state_mb, a.every, a.window, a.warmup) for w in (0, a.workers)]
    base, loaded = arms
    ratio = (loaded["delta_pause_s"] / base["delta_pause_s"]) if base["delta_pause_s"] and loaded["delta_pause_s"] \
        else None
    result = {"machine": machine(), "args": vars(a), "arms": arms, "delta_pause_ratio": ratio}
    OUT.mkdir(exist_ok=True)
    (OUT / "snapshot_workers.json").write_text(json.dumps(result, indent=1))
    for r in arms:
        print(f"{r['workers']} loader workers a rank: delta snapshot pause {r['delta_pause_s']} s "
              f"({(r['delta_bytes'] or 0) / 1e6:.0f} MB), whole {r['whole_pause_s']} s "
              f"({(r['whole_bytes'] or 0) / 1e6:.0f} MB), share of time at one a minute "
              f"{r.get('share_at_one_a_minute', 0):.3%}")
        print(f"  a delta's phases (s): {r['delta_phases_s']}; its slowest part's steps (s): {r['delta_part_steps_s']}")
    print(f"delta pause with {a.workers} workers / without: {ratio:.2f} x" if ratio else "no ratio")


if __name__ == "__main__":
    main()

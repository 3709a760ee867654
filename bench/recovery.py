"""Unplanned failures: what in-memory snapshots cost a running job, and what a recovery from one
gives back, beside checkpoint-restart from the job's own torch.save checkpoint, in one run.

The job: the test suite's 4-rank torch DDP job (gloo, each rank with its own address, --state-mb
of extra state a rank), ranks 0-1 on host-a, 2-3 on host-b, a spare; agents and coordinator real,
hosts as network namespaces.  The job runs at full speed (no sleep per step).

1. baseline: the job's step rate with no snapshot, over --window seconds.
2. snapshots every --every seconds (set through the API on the running job): each snapshot's
   pause as the coordinator timed it and as the job saw it (its longest step gap around it), and
   the step rate over the same window, which also carries the replication to the buddy that runs
   after the resume.  The slowdown at one snapshot a minute is projected from these: the time
   each snapshot costs the job (its step rate's loss times the interval), over 60 s.
3. host-b is killed outright (agent and ranks SIGKILLed, its link cut): the recovery's own pause
   (its phases), the time to detect the failure, the steps redone (the step reached at the kill
   minus the step of the snapshot), and the job's total time lost: from the kill until the job
   is past the step it had reached.
4. checkpoint-restart (bench/compare.py): the same job saves everything with torch.save, every
   rank exits, is relaunched, loads and continues: its save pause and its restart pause.

5. torchft (bench/torchft_run.py): the same model, data and extra state written for torchft, each
   rank a replica group of one; groups 2 and 3 SIGKILLed, then relaunched: its per-step cost
   against plain DDP, the survivors' stall at the failure, and the relaunched groups' time to
   step again (start-up, quorum, healing from a live peer).

With checkpoint-restart at the same interval as the snapshots, the work redone is the same on
average (half an interval); what differs is the pause to save and the pause to resume.  torchft
redoes nothing but needs its code in the job, and trains on with fewer groups (a different run).

Writes bench/out/recovery.json; prints a summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import torchft_run  # noqa: E402
from bench.common import machine  # noqa: E402
from bench.compare import checkpoint_restart  # noqa: E402
from pitstop.dev.devcluster import LocalCluster, step_times, wait_for_step  # noqa: E402
from pitstop.dev.netns import NetHosts  # noqa: E402
from pitstop.wire.coordinator_client import CoordinatorClient  # noqa: E402
from tests.helpers import ddp_cmd, let_finish  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
WORLD = 4


def _rate(log: Path, t0: float, t1: float) -> float:
    steps = [s for s, t in step_times(log) if t0 <= t <= t1]
    return (len(steps) - 1) / (t1 - t0) if len(steps) > 1 else 0.0


def _step_at(log: Path, at: float) -> int:
    done = [s for s, t in step_times(log) if t <= at]
    return max(done) if done else 0


def _gap_around(log: Path, t0: float, t1: float) -> float:
    ts = [t for _, t in step_times(log)]
    gaps = [b - a for a, b in zip(ts, ts[1:]) if b >= t0 and a <= t1]
    return max(gaps) if gaps else 0.0


def run(state_mb: float, every: float, window: float, steps: int) -> dict:
    with LocalCluster() as cluster:
        cluster.net = NetHosts()
        cluster.start_coordinator()
        with cluster.starting():
            for name in ("host-a", "host-b"):
                cluster.start_agent(name)
            cluster.start_agent("spare-1", spare=True)
        cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
        out = cluster.root / "out"
        addrs = {r: cluster.worker_address(r) for r in range(WORLD)}
        ranks = cluster.start_job("train", ddp_cmd(out, steps=steps, state_mb=state_mb), WORLD,
                                  {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}, addresses=addrs)
        let_finish(out)
        log = ranks[0].log
        wait_for_step(log, 20)
        deadline = time.time() + 60
        while len([w for j in cc.jobs() if j["job"] == "train" for w in j["workers"]]) < WORLD:
            if time.time() > deadline:
                raise SystemExit("the job's ranks did not all register")
            time.sleep(0.2)
        t0 = time.time()
        time.sleep(window)
        base_rate = _rate(log, t0, time.time())

        cc.set_snapshots("train", every)
        first = time.time()
        while not [s for s in cc.snapshots("train")["snapshots"] if s["state"] == "committed"]:
            if time.time() - first > 120:
                raise SystemExit(f"no snapshot within 120 s: {cc.snapshots('train').get('last_error')}")
            time.sleep(0.2)
        first_pause = cc.snapshots("train")["snapshots"][-1]["pause_s"]  # the whole one; then deltas
        t1 = time.time()
        time.sleep(window)
        t2 = time.time()
        snap_rate = _rate(log, t1, t2)
        info = cc.snapshots("train")
        committed = [s for s in info["snapshots"] if s["state"] == "committed"]
        history = []  # every snapshot the coordinator logged committed, the first (whole) one left out
        for line in (cluster.root / "coordinator.log").read_text().splitlines():
            if "snapshot committed" in line and "job=train" in line:
                history.append(float(line.split("pause_s=")[1].split()[0]))
        history = history[1:]
        if not committed:
            raise SystemExit(f"no snapshot committed in {window} s: {info.get('last_error')}")
        last = committed[-1]
        seen = _gap_around(log, last["created"], last["created"] + last["pause_s"] + 1)

        kill_at = time.time()
        step_at_kill = _step_at(log, kill_at)
        snap_now = [s for s in cc.snapshots("train")["snapshots"] if s["state"] == "committed"][-1]
        cluster.kill_host("host-b")
        op = None
        while op is None or not op["done"]:
            if time.time() - kill_at > 180:
                raise SystemExit("no recovery within 180 s")
            time.sleep(0.2)
            op = next((o for o in cc.ops() if o["metadata"].get("job") == "train"), None)
        m = op["metadata"]
        if m.get("result") != "succeeded":
            raise SystemExit(f"the recovery failed: {op.get('error')}")
        done_at = float(m.get("update_time") or time.time())
        end = time.time() + 300
        while not [t for s, t in step_times(log) if s == step_at_kill + 1 and t > done_at]:
            if time.time() > end:
                raise SystemExit("the recovered job did not reach the step of the failure again")
            time.sleep(0.2)
        back_at = next(t for s, t in step_times(log) if s == step_at_kill + 1 and t > done_at)
        snap_step = _step_at(log, snap_now["created"])
        started = op.get("metadata", {}).get("create_time") or kill_at
        cc.signal_job("train", 9)
        cluster.net.cut("host-b", up=True)
        pitstop = {
            "snapshot_every_s": every, "state_mb": state_mb,
            "step_rate_no_snapshots": round(base_rate, 3), "step_rate_with_snapshots": round(snap_rate, 3),
            "first_snapshot_pause_s": first_pause,
            "snapshot_pause_s": history, "snapshot_pause_median_s": round(statistics.median(history), 4),
            "snapshot_job_gap_s": round(seen, 4), "snapshot_bytes": last.get("bytes"),
            "snapshot_phases": last.get("phases"),
            "snapshots_in_window": len(history),
            "recovery_pause_s": m["pause_s"], "recovery_phases": m["phases"],
            "detection_s": round(float(started) - kill_at, 3),
            "steps_redone": step_at_kill - snap_step, "work_redone_s": m["lost_s"],
            "time_lost_s": round(back_at - kill_at, 3),
        }
        loss_per_snapshot = max(0.0, 1 - snap_rate / base_rate) * every if base_rate else 0.0
        pitstop["cost_per_snapshot_s"] = round(loss_per_snapshot, 4)
        pitstop["slowdown_at_1_per_min"] = round(loss_per_snapshot / 60, 5)
    ckpt = checkpoint_restart(WORLD, state_mb, steps=60, save_at=20)
    ft = torchft_run.run(WORLD, lost=(2, 3), state_mb=state_mb, window=min(window, 30.0))
    return {"pitstop": pitstop, "checkpoint_restart": {k: ckpt[k] for k in ("job_pause_s", "phases", "checkpoint_bytes",
                                                                           "median_step_s")},
            "torchft": {"version": version("torchft"), **ft}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-mb", type=float, default=128.0, help="extra state a rank holds (MB)")
    ap.add_argument("--every", type=float, default=10.0, help="seconds between snapshots while measured")
    ap.add_argument("--window", type=float, default=50.0, help="seconds each step rate is measured over")
    ap.add_argument("--steps", type=int, default=100000, help="the job's steps (it is stopped after the recovery)")
    a = ap.parse_args()
    r = {"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M"), "args": vars(a), **run(a.state_mb, a.every,
                                                                                                a.window, a.steps)}
    OUT.mkdir(exist_ok=True)
    (OUT / "recovery.json").write_text(json.dumps(r, indent=1))
    p, c = r["pitstop"], r["checkpoint_restart"]
    save = c["phases"]["save"]
    print(json.dumps(r, indent=1))
    print(f"\nsnapshot: pause {p['snapshot_pause_median_s']:.2f} s (job saw {p['snapshot_job_gap_s']:.2f} s), "
          f"{p['cost_per_snapshot_s']:.2f} s of the job's time each, {100 * p['slowdown_at_1_per_min']:.2f} % at one a "
          f"minute; torch.save of the same state: {save:.2f} s")
    print(f"recovery: pause {p['recovery_pause_s']:.2f} s, detection {p['detection_s']:.1f} s, {p['steps_redone']} steps "
          f"redone; job's time lost {p['time_lost_s']:.1f} s.  checkpoint-restart's restart pause: "
          f"{c['job_pause_s']:.2f} s ({c['job_pause_s'] - save:.2f} s without the save)")
    t = r["torchft"]
    back = max(t["relaunch_to_stepping_s"].values())
    print(f"torchft {t['version']}: {100 * t['per_step_cost']:+.1f} % a step against plain DDP; survivors stalled "
          f"{t['stall_at_failure_s']:.1f} s at the failure and {t['survivors_stall_at_join_s']:.2f} s at the join; "
          f"relaunched groups stepping {back:.1f} s after their relaunch ({t['groups_missing_s']:.1f} s with "
          f"{len(t['groups_lost'])} of {t['world']} groups missing)")


if __name__ == "__main__":
    main()

"""The early rewire against the rewire after the restore, in one run, on the host NCCL.

A 4-rank NCCL job (tests/workloads/nccl_tp_dp.py over native/build/libnccl.so: a world and four
pairs, real TCP bootstraps) on two hosts that are network namespaces with their own addresses; host
b's two ranks are evacuated to a spare.  Arms, alternating run by run so that drift falls on both:

- early: the default: the ranks that stay make fresh ids and begin re-creating their communicators
  as the leaving ranks' capture begins; the restored ranks join them (coordinator/cut.py);
- after: PITSTOP_COORDINATOR_EARLY_REWIRE=false: every rank re-creates them once the leaving ranks
  are restored, inside the pause.

Reported per arm (median, min, max of --runs): what the restore leaves in the pause, from the last
restored rank running on the spare (EvacuationState.last_restore) to every rank's first collective
done (the ranks' shims, AfterMove.first_collectives_at); the rewire phase as the coordinator timed
it; the downtime.  Both clocks are this machine's.  Writes bench/out/early_rewire.json.

    .venv/bin/python bench/early_rewire.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, until  # noqa: E402
from pitstop.dev.devcluster import LocalCluster  # noqa: E402
from pitstop.dev.netns import NetHosts  # noqa: E402
from pitstop.wire.coordinator_client import CoordinatorClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "tests" / "workloads"
OUT = ROOT / "bench" / "out" / "early_rewire.json"
ARMS = {"early": {}, "after": {"PITSTOP_COORDINATOR_EARLY_REWIRE": "false"}}


def _step(log: Path) -> int:
    steps = [int(ln.split()[1]) for ln in log.read_text(errors="replace").splitlines() if ln.startswith("step ")]
    return max(steps, default=0)


def one_run(arm: str, steps: int) -> dict:
    """One cluster, one evacuation of host-b with the arm's setting; its figures."""
    with LocalCluster(root=Path(tempfile.mkdtemp(prefix="pitstop-rewire-"))) as c:
        c.net = NetHosts()
        c.start_coordinator(env=ARMS[arm])
        with c.starting():
            c.start_agent("host-a")
            c.start_agent("host-b")
            c.start_agent("spare-1", spare=True)
        rdv, out = c.root / "rdv", c.root / "out"
        rdv.mkdir()
        cmd = [sys.executable, str(WORKLOADS / "nccl_tp_dp.py"), "--steps", str(steps), "--step-sleep", "0.02",
               "--pace-file", str(c.root / "out.pace"), "--rendezvous", str(rdv), "--out", str(out)]
        ranks = c.start_job("nccl", cmd, 4, {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"},
                            env={"PYTHONPATH": str(WORKLOADS)}, run_args=["--host-nccl"])
        cc = CoordinatorClient(c.coordinator_url, c.operator_token)
        until(lambda: _step(ranks[3].log) >= 30, 120, what="step 30 of rank 3")
        op = cc.evacuate("host-b", reason=f"bench: early rewire, arm {arm}")
        op = until(lambda: (o := cc.op(op["name"]))["done"] and o, 180, what="the evacuation")
        md = op["metadata"]
        if md["result"] != "succeeded":
            raise RuntimeError(f"arm {arm}: the evacuation failed: {op.get('error')}")
        entry = until(lambda: next((m for m in cc.moves() if m["operation"] == op["name"] and m["after_move"]
                                     and m["after_move"].get("first_collectives_at")), None),
                       60, what="the ledger's after-move figures")
        a = entry["after_move"]
        (c.root / "out.pace").write_text("0\n")
        codes = [r.proc.wait(180) for r in ranks]
        if codes != [0] * 4:
            raise RuntimeError(f"arm {arm}: ranks exited {codes}")
        early = bool(md["cut"].get("early"))
        if early != (arm == "early"):
            raise RuntimeError(f"arm {arm}: the move's early rewire was {early} ({md['cut'].get('early_why_not')})")
        return {"arm": arm, "restore_to_first_collectives_s": round(a["first_collectives_at"] - md["last_restore"], 4),
                "rewire_s": round(md["phases"]["rewire"], 4) if isinstance(md["phases"].get("rewire"), (int, float))
                else md["phases"].get("rewire"),
                "prewire_s": md["cut"].get("prewire_s"), "downtime_s": md["downtime_s"],
                "first_collectives_s": a["first_collectives_s"]}


def _summary(runs: list[dict], key: str) -> dict | None:
    xs = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    if not xs:
        return None
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs per arm, alternating")
    ap.add_argument("--steps", type=int, default=1500,
                    help="the job's steps: paced at 0.02 s until the move has ended, then run out at full speed")
    ap.add_argument("--out", type=Path, default=OUT)
    a = ap.parse_args()
    if a.runs < 1:
        raise SystemExit("--runs must be at least 1")
    runs: list[dict] = []
    for i in range(a.runs):
        for arm in (("early", "after") if i % 2 == 0 else ("after", "early")):
            r = one_run(arm, a.steps)
            print(json.dumps(r), flush=True)
            runs.append(r)
    report = {"machine": machine(), "runs": runs, "arms": {
        arm: {k: _summary([r for r in runs if r["arm"] == arm], k)
              for k in ("restore_to_first_collectives_s", "rewire_s", "prewire_s", "downtime_s")}
        for arm in ARMS}}
    e, f = (report["arms"][x]["restore_to_first_collectives_s"]["median"] for x in ("early", "after"))
    report["after_over_early"] = round(f / e, 2) if e else None
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["arms"], indent=2))
    print(f"restore to first collectives: early {e:.3f} s, after {f:.3f} s (x{report['after_over_early']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

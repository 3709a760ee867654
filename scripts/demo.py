"""`make demo`: a local cluster, a live training job, an evacuation, and the proof.

Starts a coordinator and three agents on loopback (host-a and host-b active,
spare-1 a spare), a 4-rank torch gloo DDP job through `pitstop run` (two ranks
per host), evacuates host-b mid-training with the real CLI, lets the job finish
and checks its final parameters against an uninterrupted run of the same job.
Everything it starts is stopped and removed at the end, also on failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pitstop.dev.devcluster import LocalCluster, free_port, pitstop_cmd, step_gaps, wait_for_step  # noqa: E402

WORKLOAD = ROOT / "tests" / "workloads" / "ddp_train.py"
STEPS = 200
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""Each rank computes on one thread, the job's and the reference's alike: torch's default (a thread
per core) puts 8 spinning OpenMP threads on a 2-core machine, and the reference run (4 ranks at
full speed) took 94-125 s that way instead of 24-28 s, with the same final parameters
(bench/results/2026-12-06-demo.md)."""


def say(msg: str) -> None:
    print(f"\n\033[1m==> {msg}\033[0m", flush=True)


def cli(cluster: LocalCluster, *args: str) -> int:
    return subprocess.run([*pitstop_cmd(), *args], env=cluster.env()).returncode


def reference(tmp: Path) -> list[str]:
    """The same job, uninterrupted and without pitstop: what the final state must be."""
    out = tmp / "reference"
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKLOAD), "--steps", str(STEPS), "--out", str(out),
                               "--step-sleep", "0"],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="4", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), USE_LIBUV="0", **ONE_THREAD),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in range(4)]
    if any(p.wait(300) for p in procs):
        raise SystemExit("the reference run failed")
    return [(out / f"rank{r}.sha256").read_text().strip() for r in range(4)]


def main() -> int:
    if os.geteuid() != 0:
        print("make demo needs root (CRIU checkpoints processes)", file=sys.stderr)
        return 1
    t0 = time.monotonic()
    with LocalCluster() as c:
        say("pitstop doctor: can this host capture and restore workers?")
        if cli(c, "doctor") != 0:
            return 1
        say("starting a coordinator and three agents (host-a, host-b active; spare-1 spare)")
        c.start_coordinator()
        with c.starting():  # side by side
            agents = [c.start_agent(name, spare=spare)
                      for name, spare in (("host-a", False), ("host-b", False), ("spare-1", True))]
        for a in agents:
            print(f"   agent {a.name:<8} {a.url}  state {a.state_dir}")
        say(f"starting a 4-rank torch DDP job (gloo, {STEPS} steps) through `pitstop run`, 2 ranks per host")
        out = c.root / "out"
        pace = c.root / "pace"  # the job sleeps 0.05 s a step while it must stay alive for the move
        ranks = c.start_job("demo", [sys.executable, str(WORKLOAD), "--steps", str(STEPS), "--out", str(out),
                                     "--state-mb", "64", "--pace-file", str(pace)], 4,
                            {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}, env=ONE_THREAD)
        wait_for_step(ranks[2].log, 30)
        cli(c, "hosts")
        cli(c, "jobs")
        say("asking first what an evacuation of host-b would do: pitstop evacuate host-b --dry-run")
        if cli(c, "evacuate", "host-b", "--dry-run") != 0:
            print("the dry run refused (see above); nothing was moved")
            return 1
        say("evacuating host-b while the job trains: pitstop evacuate host-b --wait")
        rc = cli(c, "evacuate", "host-b", "--wait")
        if rc != 0:
            print("the evacuation failed (see above); the job keeps running where it was")
        say("the job continues; waiting for it to finish")
        pace.write_text("0\n")  # nothing left to move: its remaining steps at full speed (same result)
        codes = [r.proc.wait(300) for r in ranks]
        print(f"   exit codes of the four `pitstop run` launchers: {codes}")
        gaps = step_gaps(ranks[2].log)
        if gaps:
            print(f"   rank 2's longest pause between two steps: {max(gaps):.2f} s "
                  f"(a normal step: {sorted(gaps)[len(gaps) // 2]:.3f} s)")
        time.sleep(2.5)  # a heartbeat or two, so the coordinator has seen the workers exit
        cli(c, "jobs")
        say("the ledger of moves, with the pause each rank saw: pitstop moves")
        cli(c, "moves")
        say("checking the final parameters against an uninterrupted run of the same job")
        want = reference(c.root)
        got = [(out / f"rank{r}.sha256").read_text().strip() if (out / f"rank{r}.sha256").exists() else "missing"
               for r in range(4)]
        for r in range(4):
            print(f"   rank {r}: {got[r][:16]}…  reference {want[r][:16]}…  "
                  f"{'identical' if got[r] == want[r] else 'DIFFERENT'}")
        ok = rc == 0 and codes == [0, 0, 0, 0] and got == want
        say(("PASS: ranks 2 and 3 moved from host-b to spare-1 mid-training; the job finished bit-for-bit "
             "identical to an uninterrupted run") if ok else "FAIL: see above")
        say(f"cleaning up (demo took {time.monotonic() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (devcluster turns it into this)
        print("\ninterrupted: everything the demo started was stopped and removed", file=sys.stderr)
        sys.exit(130)

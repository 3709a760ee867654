"""The pause and resume rounds alone, with SCHED_FIFO (pitstop/priority.py) and without.

    .venv/bin/python bench/control_rounds.py [--worlds 8,2] [--rounds 20] [--repeats 2]
                                             [--out bench/out/control-rounds.json]

A move's downtime begins with one round (the coordinator asks each agent to stop its ranks)
and ends with another (to continue them); with more busy ranks than cores both grew with the
job.  Here they are timed alone, as the coordinator makes them: an agent with a job of N ranks
(64 MiB of state each, training, all on it), a client that pauses and resumes the N-1 peers in
one call each (`pause_many`, `resume_many`), from a thread boosted like the coordinator's when
the agent is (PITSTOP_AGENT_REALTIME), `--rounds` times, 0.3 s apart.  Each (size, mode) gets a
fresh cluster; the order of the modes alternates from repeat to repeat.  Reports the round
trips' medians and 90th percentiles: what the coordinator waits for (the agent's own share of
it is not separated).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import write_ab  # noqa: E402
from bench.compare import OUT  # noqa: E402
from pitstop import priority  # noqa: E402
from pitstop.dev.devcluster import LocalCluster, wait_for_step  # noqa: E402
from tests.helpers import ddp_cmd  # noqa: E402


def _p90(xs: list[float]) -> float:
    return sorted(xs)[int(0.9 * (len(xs) - 1))]


def rounds(world: int, realtime: bool, n: int) -> dict:
    with LocalCluster(root=Path(tempfile.mkdtemp(prefix="pitstop-bench-rounds-"))) as c:
        c.start_agent("host-a", env={"PITSTOP_AGENT_REALTIME": "true" if realtime else "false"})
        ranks = c.start_job("b", ddp_cmd(c.root / "out", steps=100_000, state_mb=64), world,
                            {r: "host-a" for r in range(world)})
        for rk in ranks:
            wait_for_step(rk.log, 20, timeout_s=300)
        cl = c.agents["host-a"].client()
        peers = sorted(w.id for w in cl.workers() if w.state == "running")[1:]
        pause, resume = [], []
        for _ in range(n):
            time.sleep(0.3)
            with priority.critical() if realtime else contextlib.nullcontext():
                t = time.perf_counter()
                cl.pause_many(peers)
                pause.append(time.perf_counter() - t)
            time.sleep(0.1)
            with priority.critical() if realtime else contextlib.nullcontext():
                t = time.perf_counter()
                cl.resume_many(peers)
                resume.append(time.perf_counter() - t)
        cl.close()
        return {"world": world, "peers": len(peers), "realtime": "on" if realtime else "off",
                "pause_s": pause, "resume_s": resume}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="8,2")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(OUT / "control-rounds.json"))
    a = ap.parse_args()
    if not priority.apply(-10, "bench"):
        raise SystemExit("this bench compares SCHED_FIFO with the nice value alone: run it as root")
    worlds = [int(w) for w in a.worlds.split(",")]
    runs = []
    for i in range(a.repeats):
        for world in worlds:
            for rt in ((False, True) if i % 2 == 0 else (True, False)):
                r = rounds(world, rt, a.rounds)
                runs.append(r)
                print(f"realtime {r['realtime']:<3} {world} ranks: pause median {statistics.median(r['pause_s']) * 1e3:.1f} "
                      f"ms (p90 {_p90(r['pause_s']) * 1e3:.1f}), resume median "
                      f"{statistics.median(r['resume_s']) * 1e3:.1f} ms (p90 {_p90(r['resume_s']) * 1e3:.1f})", flush=True)
    summary = {}
    for world in worlds:
        for mode in ("off", "on"):
            ps = [x for r in runs if r["world"] == world and r["realtime"] == mode for x in r["pause_s"]]
            rs = [x for r in runs if r["world"] == world and r["realtime"] == mode for x in r["resume_s"]]
            summary[f"{world} ranks, realtime {mode}"] = {
                "median_pause_s": statistics.median(ps), "p90_pause_s": _p90(ps),
                "median_resume_s": statistics.median(rs), "p90_resume_s": _p90(rs)}
    write_ab(Path(a.out), summary, runs)


if __name__ == "__main__":
    main()

"""The pause of a rank in a container against the same rank bare, in one run.

    .venv/bin/python bench/container_pause.py --state-mb 256 --rounds 3

Two identical 2-rank gloo DDP jobs run side by side on the same two agents: one as bare
processes under `pitstop run`, one whose ranks are podman containers (`podman run ... IMAGE
pitstop run -- python train.py`, runc).  Rank 1 of each is moved back and forth between the
agents, the two jobs taking turns, `--rounds` times each; every move's downtime (first pause to
resume, as the driver records it) and the pause its own rank 0 saw (the longest gap between its
steps) are kept.  The bare rank is moved whole (no pre-copy: a container's runtime takes none) and,
with --pre-copy, once more per round with the pre-copy an evacuation does by default.  Prints the
medians and container / bare; writes bench/out/container_pause.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine  # noqa: E402
from pitstop.dev.containers import PodmanHost, image_store, image_tarball  # noqa: E402
from pitstop.dev.devcluster import LocalCluster, free_port, step_gaps, wait_for_step  # noqa: E402
from pitstop.migration.move import move_worker  # noqa: E402

WORKLOAD = Path(__file__).resolve().parent.parent / "tests" / "workloads" / "ddp_train.py"


def _cmd(out: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(WORKLOAD), "--steps", str(args.steps), "--out", str(out),
            "--state-mb", str(args.state_mb), "--step-sleep", "0.05", "--pace-file", str(out) + ".pace"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-mb", type=float, default=256.0, help="extra state in each rank (MiB)")
    ap.add_argument("--rounds", type=int, default=3, help="moves of each rank")
    ap.add_argument("--steps", type=int, default=100000, help="the jobs' steps (they are stopped at the end)")
    ap.add_argument("--pre-copy", action="store_true", help="also move the bare rank with pre-copy each round")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out" / "container_pause.json"))
    args = ap.parse_args()

    store, image = image_store(image_tarball())
    moves: list[dict] = []
    with LocalCluster() as c:
        hosts = {n: PodmanHost(n, c.root / f"podman-{n}", store) for n in "ab"}
        try:
            socks = {n: c.root / f"sock-{n}" for n in "ab"}
            with c.starting():
                for n in "ab":
                    socks[n].mkdir()
                    c.start_agent(n, spare=n == "b", env={**hosts[n].env,
                                                          "PITSTOP_AGENT_SOCKET_PATH": str(socks[n] / "agent.sock")})
            jobdir = c.root / "job"
            jobdir.mkdir()
            bare_out, ctr_out = jobdir / "bare", jobdir / "ctr"
            bare = c.start_job("bare", _cmd(bare_out, args), 2, {0: "a", 1: "a"})
            port = free_port()
            for r in (0, 1):
                hosts["a"].run_rank(f"ctr-{r}", image, "ctr", r, 2, socks["a"], _cmd(ctr_out, args),
                                    {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                                    mounts=[(str(jobdir), str(jobdir))])
            for wid in ("bare.1", "ctr.0", "ctr.1"):
                c.wait_registered("a", wid, timeout_s=120)
            wait_for_step(bare[1].log, 20)
            ctr_log = jobdir / "ctr-0.log"  # rank 0's steps, as its container's log has them (it never moves)
            end = time.monotonic() + 120
            while "step 20 " not in hosts["a"].logs("ctr-0") and time.monotonic() < end:
                time.sleep(0.5)
            where = {"bare": "a", "ctr": "a"}
            kinds = ["ctr", "bare"] + (["bare-precopy"] if args.pre_copy else [])
            for i in range(args.rounds):
                for kind in kinds[i % 2:] + kinds[:i % 2]:
                    job = kind.split("-")[0]
                    src, dst = where[job], "b" if where[job] == "a" else "a"
                    sa, da = c.agents[src].client(), c.agents[dst].client()
                    mark = time.time()
                    rep = move_worker(sa, da, f"{job}.1", dest_name=dst, peers=[(c.agents["a"].client(), f"{job}.0")],
                                      pre_copy=kind == "bare-precopy")
                    where[job] = dst
                    time.sleep(2.0)  # the job's steps after the move, for the pause it saw
                    if job == "ctr":
                        ctr_log.write_text(hosts["a"].logs("ctr-0"))
                    gaps = step_gaps(ctr_log if job == "ctr" else bare[0].log, since=mark)
                    moves.append({"kind": kind, "round": i, "from": src, "to": dst, "bytes": rep.bytes,
                                  "downtime_s": round(rep.downtime_s, 4),
                                  "job_pause_s": round(max(gaps), 4) if gaps else None,
                                  "phases_s": {k: round(v, 4) for k, v in rep.phases.items()}})
                    print(f"{kind:<13} {src}->{dst} downtime {rep.downtime_s:.3f} s, rank 0 saw "
                          f"{moves[-1]['job_pause_s']} s, {rep.bytes / 2**20:.0f} MiB", flush=True)
                    time.sleep(1.0)
        finally:
            for h in hosts.values():
                h.close()

    def med(kind: str, key: str) -> float:
        return statistics.median(m[key] for m in moves if m["kind"] == kind and m[key] is not None)

    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "state_mb": args.state_mb, "rounds": args.rounds, "moves": moves,
           "median_downtime_s": {k: med(k, "downtime_s") for k in kinds},
           "median_job_pause_s": {k: med(k, "job_pause_s") for k in kinds}}
    res["container_over_bare"] = {
        "downtime": round(res["median_downtime_s"]["ctr"] / res["median_downtime_s"]["bare"], 3),
        "job_pause": round(res["median_job_pause_s"]["ctr"] / res["median_job_pause_s"]["bare"], 3)}
    if args.pre_copy:
        res["container_over_bare_precopy"] = {
            "downtime": round(res["median_downtime_s"]["ctr"] / res["median_downtime_s"]["bare-precopy"], 3)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"median downtime: {res['median_downtime_s']}; median pause rank 0 saw: {res['median_job_pause_s']}")
    print(f"container / bare: {res['container_over_bare']}"
          + (f"; container / bare with pre-copy: {res['container_over_bare_precopy']}" if args.pre_copy else ""))


if __name__ == "__main__":
    main()

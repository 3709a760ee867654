"""Failover: how long an operation waits when the coordinator leading it dies.

Two coordinators on a private PostgreSQL (pitstop.dev.devpostgres, durable), three real agents, a
one-rank job on host-b.  Each run evacuates host-b with the capture held on the agent (a fault
point: the move is then surely in flight), kills the leading coordinator (SIGKILL, as its host
dying) and measures, from the kill:

- takeover: until the standby says it leads (GET /v1/leader, polled every 20 ms);
- first step: until the new leader's first write to the operation (its `Resumed` condition, the
  record's update time): the moment it began driving the operation again;
- done: until the operation is rolled back (the job runs on where it was).

The killed coordinator is started again (it stands by) and the next run kills the other one.
The lease is the default (PITSTOP_COORDINATOR_LEASE_S=3); the figures are medians and the worst of
--runs runs; writes bench/out/failover.json.

    .venv/bin/python bench/failover.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, until  # noqa: E402
from pitstop.dev.devcluster import LocalCluster  # noqa: E402
from pitstop.dev.devpostgres import PrivatePostgres  # noqa: E402
from pitstop.wire.coordinator_client import CoordinatorClient  # noqa: E402

WORKLOADS = Path(__file__).resolve().parents[1] / "tests" / "workloads"
HOLD_S = 10  # the capture held on host-b: long enough for any takeover


def one_run(c: LocalCluster, cc: CoordinatorClient) -> dict:
    leader = until(c.leader, 30, every=0.02)
    standby = next(x for x in c.coordinators if x is not leader)
    op = cc.evacuate("host-b", reason="bench: failover")
    until(lambda: cc.op(op["name"])["metadata"]["phase"] == "capture", 120, every=0.02)
    time.sleep(1)
    before = cc.op(op["name"])["metadata"]["update_time"]
    killed_at, t0 = time.time(), time.monotonic()
    os.killpg(leader.proc.pid, signal.SIGKILL)
    leader.proc.wait(10)
    until(lambda: httpx.get(standby.url + "/v1/leader", timeout=2).json()["role"] == "leader", 30, every=0.02)
    takeover = time.monotonic() - t0

    def resumed() -> float | None:
        md = httpx.get(f"{standby.url}/v1/{op['name']}", timeout=2,
                       headers={"Authorization": f"Bearer {c.operator_token}"}).json()["metadata"]
        if md["update_time"] > before and any(x["type"] == "Resumed" for x in md.get("conditions", [])):
            return md["update_time"]
        return None

    first = until(resumed, 60, every=0.02) - killed_at
    done = until(lambda: (o := cc.op(op["name"]))["done"] and o, 240, every=0.1)
    took = time.monotonic() - t0
    assert done["metadata"]["result"] == "failed", done  # rolled back: the job runs on host-b
    c.restart_coordinator(leader)  # back, as a standby, for the next run
    return {"takeover_s": round(takeover, 3), "first_step_s": round(first, 3), "done_s": round(took, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    pg = PrivatePostgres(durable=True)
    runs: list[dict] = []
    try:
        with LocalCluster(root=Path(tempfile.mkdtemp(prefix="pitstop-failover-"))) as c:
            db = pg.create_database()
            c.start_coordinators([db, db])
            with c.starting():
                c.start_agent("host-a")
                c.start_agent("host-b", env={"PITSTOP_ENABLE_FAULTS": "1",
                                             "PITSTOP_FAULTS": f"capture:before_dump=sleep:{HOLD_S}"})
                c.start_agent("spare-1", spare=True)
            cc = CoordinatorClient(c.coordinator_url, c.operator_token)
            ranks = c.start_job("bench", [sys.executable, str(WORKLOADS / "sleeper.py"), "3600"], 1, {0: "host-b"})
            c.wait_registered("host-b", "bench.0")
            for i in range(a.runs):
                runs.append(one_run(c, cc))
                print(f"run {i + 1}: {runs[-1]}", flush=True)
            ranks[0].proc.terminate()
            for co in c.coordinators:
                if co.proc.poll() is None:
                    co.proc.terminate()
                    co.proc.wait(30)
    finally:
        pg.close()
    summary = {k: {"median": round(statistics.median(r[k] for r in runs), 3), "max": max(r[k] for r in runs)}
               for k in ("takeover_s", "first_step_s", "done_s")}
    res = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv),
           "lease_s": 3.0, "database": "PostgreSQL 15 (private, durable)", "runs": runs, "summary": summary}
    Path("bench/out").mkdir(parents=True, exist_ok=True)
    Path("bench/out/failover.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""The pause a torch job sees when a host is evacuated: workers on a shared network vs
workers with their own addresses (network namespaces, `pitstop run --address`).

Same job (4-rank gloo DDP, ranks 2 and 3 on host-b), same machine, one run; host-b is
evacuated to a spare through the coordinator in each setting.  Reports the op's downtime
and phases, and the longest gap between rank 0's steps (the pause as the job saw it)
next to its median step.  Writes bench/out/address_move.json.

    .venv/bin/python bench/address_move.py [--steps 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import evacuate_and_wait, job_pause, machine  # noqa: E402
from pitstop.dev.devcluster import LocalCluster, wait_for_step  # noqa: E402
from pitstop.dev.netns import NetHosts  # noqa: E402
from pitstop.wire.coordinator_client import CoordinatorClient  # noqa: E402
from tests.helpers import ddp_cmd  # noqa: E402


def one(own_addresses: bool, steps: int) -> dict:
    with LocalCluster(root=Path(tempfile.mkdtemp(prefix="pitstop-bench-"))) as c:
        if own_addresses:
            c.net = NetHosts()
        c.start_coordinator()
        for name in ("host-a", "host-b"):
            c.start_agent(name)
        c.start_agent("spare-1", spare=True)
        cc = CoordinatorClient(c.coordinator_url, c.operator_token)
        addrs = {r: c.worker_address(r) for r in range(4)} if own_addresses else None
        ranks = c.start_job("b", ddp_cmd(c.root / "out", steps=steps), 4,
                            {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}, addresses=addrs)
        wait_for_step(ranks[3].log, 30)
        t0 = time.time()
        md = evacuate_and_wait(cc, "host-b")
        codes = [r.proc.wait(300) for r in ranks]
        assert codes == [0, 0, 0, 0], codes
        pause, median = job_pause(ranks[0].log, since=t0)
        return {"own_addresses": own_addresses, "downtime_s": md["downtime_s"], "job_pause_s": pause,
                "median_step_s": median, "bytes": md["bytes_total"],
                "phases": {k: round(v, 3) for k, v in md["phases"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    runs = [one(own, a.steps) for _ in range(a.rounds) for own in (False, True)]
    out = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "command": " ".join(sys.argv), "runs": runs}
    Path("bench/out").mkdir(parents=True, exist_ok=True)
    Path("bench/out/address_move.json").write_text(json.dumps(out, indent=1))
    print(f"{'network':<16}{'downtime s':>11}{'job pause s':>12}{'median step s':>14}{'MB moved':>10}")
    for r in runs:
        print(f"{'own addresses' if r['own_addresses'] else 'shared':<16}{r['downtime_s']:>11.2f}"
              f"{r['job_pause_s']:>12.2f}{r['median_step_s']:>14.3f}{r['bytes'] / 1e6:>10.0f}")
    for r in runs:
        print(("own addresses" if r["own_addresses"] else "shared"), r["phases"])


if __name__ == "__main__":
    main()

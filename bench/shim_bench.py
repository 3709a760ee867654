"""The NCCL shim's costs: per collective in steady state, and quiesce + rewire as the job grows.

    .venv/bin/python bench/shim_bench.py            (writes bench/out/shim_bench.json)

1. Per-call cost: bench/collective_cost.c times 200,000 one-element allreduces over the host
   NCCL (world of 1), alone and with the shim preloaded, alternating runs; the difference of
   the medians is what the shim adds to every collective.  Target: at most 1 us.
2. Quiesce + rewire: a data-parallel job of 2, 4, 8 and 16 ranks (tests/workloads/nccl_dp.py)
   is brought to a consistent cut, its communicators destroyed and re-created with new unique
   ids, directly through the control blocks (no agents, no capture): the part of the downtime
   the shim owns.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import machine  # noqa: E402
from pitstop import shimctl  # noqa: E402
from pitstop.coordinator.cut import Cut  # noqa: E402

NATIVE, SHIM = ROOT / "native" / "build", ROOT / "shim" / "build" / "libpitstop_shim.so"


def per_call(runs: int = 7) -> dict:
    exe = Path(tempfile.mkdtemp()) / "collective_cost"
    subprocess.run(["cc", "-O2", "-o", str(exe), str(ROOT / "bench" / "collective_cost.c"), f"-L{NATIVE}", "-lnccl"],
                   check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=str(NATIVE), HOSTNCCL_ADDR="127.0.0.1")
    plain, shim = [], []
    for _ in range(runs):
        plain.append(float(subprocess.run([str(exe)], env=env, capture_output=True, text=True, check=True).stdout))
        shim.append(float(subprocess.run([str(exe)], env=dict(env, LD_PRELOAD=str(SHIM)), capture_output=True,
                                         text=True, check=True).stdout))
    return {"host_nccl_ns": statistics.median(plain), "with_shim_ns": statistics.median(shim),
            "shim_ns": statistics.median(shim) - statistics.median(plain), "runs": runs}


def quiesce_rewire(world: int, cycles: int = 3) -> dict:
    rdv, out = tempfile.mkdtemp(), tempfile.mkdtemp()
    env = dict(os.environ, LD_LIBRARY_PATH=str(NATIVE), PYTHONPATH=str(ROOT / "tests" / "workloads"),
               LD_PRELOAD=str(SHIM), HOSTNCCL_ADDR="127.0.0.1", WORLD_SIZE=str(world))
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "workloads" / "nccl_dp.py"), "--steps", "100000",
                               "--step-sleep", "0.005", "--rendezvous", rdv, "--out", out],
                              env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for r in range(world)]
    try:
        pids = {f"r{r}": p.pid for r, p in enumerate(procs)}
        end = time.monotonic() + 60
        while time.monotonic() < end and not all(shimctl.blocks(p) and shimctl.blocks(p)[0].comms
                                                 for p in pids.values()):
            time.sleep(0.1)
        time.sleep(1.0)

        def post(w: str, body: dict) -> None:
            for b in shimctl.blocks(pids[w]):
                if body["op"] == "quiesce":
                    shimctl.quiesce(b, body["gen"])
                elif body["op"] == "targets":
                    shimctl.set_targets(b, body["targets"])
                else:
                    shimctl.command(b, body["command"], body.get("ids"))

        rows = []
        for _ in range(cycles):
            cut = Cut(list(pids), lambda w: [b.view() for b in shimctl.blocks(pids[w])], post, deadline_s=60)
            t0 = time.monotonic()
            res = cut.quiesce()
            t1 = time.monotonic()
            cut.destroy()
            t2 = time.monotonic()
            cut.rewire()
            t3 = time.monotonic()
            rows.append({"quiesce_s": t1 - t0, "destroy_s": t2 - t1, "rewire_s": t3 - t2, "rounds": res.rounds})
            time.sleep(0.5)
        return {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
           "per_call": per_call(), "quiesce_rewire": {}}
    pc = res["per_call"]
    print(f"per allreduce: host NCCL {pc['host_nccl_ns']:.1f} ns, with shim {pc['with_shim_ns']:.1f} ns, "
          f"shim adds {pc['shim_ns']:.1f} ns ({res['machine']})")
    print(f"{'ranks':>5} {'quiesce s':>10} {'destroy s':>10} {'rewire s':>10} {'rounds':>7}")
    for world in (2, 4, 8, 16):
        r = res["quiesce_rewire"][world] = quiesce_rewire(world)
        print(f"{world:>5} {r['quiesce_s']:>10.4f} {r['destroy_s']:>10.4f} {r['rewire_s']:>10.4f} {r['rounds']:>7}")
    out = ROOT / "bench" / "out" / "shim_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

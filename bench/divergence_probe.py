"""Probe for a gloo divergence across a move (the one seen up to 2026-12-01 was torch's MKL race:
bench/vml_race_probe.py, docs/reliability.md): evacuate a 2-rank
job's second host N times and report, for each run, the first step at which the ranks'
parameter digests differ (ddp_train --trace-params) next to the step after which the move
happened.  Optional CPU burners add load.  Not a benchmark: a diagnostic.

    .venv/bin/python bench/divergence_probe.py RUNS [BURNERS] [rollback]

With "rollback", host-b's agent breaks the image stream after 20 MB (fault hook
transfer:cut_after), so every run is a rollback by restore on the source: where the
divergence was last seen.  A divergent run's logs are copied to bench/out/divergence-<it>/.
"""
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import first_divergent_step, keep_logs, moved_after_step
from pitstop.dev.devcluster import LocalCluster, wait_for_step
from pitstop.wire.coordinator_client import CoordinatorClient
from tests.helpers import ddp_cmd

N = int(sys.argv[1]); load = int(sys.argv[2]) if len(sys.argv) > 2 else 0
rollback = len(sys.argv) > 3 and sys.argv[3] == "rollback"
burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
try:
    for it in range(N):
        with LocalCluster(root=Path(tempfile.mkdtemp(prefix="diag-"))) as c:
            c.start_coordinator()
            c.start_agent("host-a")
            c.start_agent("host-b", env={"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": "transfer:cut_after=20000000"}
                          if rollback else None)
            c.start_agent("spare-1", spare=True)
            cc = CoordinatorClient(c.coordinator_url, c.operator_token)
            out = c.root / "out"
            cmd = ddp_cmd(out, steps=80) + ["--trace-params"]
            ranks = c.start_job("d", cmd, 2, {0: "host-a", 1: "host-b"})
            wait_for_step(ranks[1].log, 10)
            op = cc.evacuate("host-b")
            while not op["done"]:
                time.sleep(0.05); op = cc.op(op["name"])
            codes = [r.proc.wait(200) for r in ranks]
            first = first_divergent_step([r.log for r in ranks])
            moved = moved_after_step(ranks[0].log, 0.0)
            print(f"it {it}: result={op['metadata']['result']} codes={codes} first_divergent_step={first} "
                  f"move_after_step={moved}", flush=True)
            if first is not None:
                keep = keep_logs(c.root, Path(__file__).resolve().parent / "out" / f"divergence-{it}")
                print(f"   logs kept in {keep}", flush=True)
finally:
    for b in burners: b.kill()

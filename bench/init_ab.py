"""pitstop's init at the root of each worker's tree (native/pitinit.c), on and off, interleaved.

    .venv/bin/python bench/init_ab.py [--pairs-2 3] [--pairs-4 2] [--out bench/out/init-ab.json]

Without the init, the command is the root of its tree and works in the job's directory, which
the ranks of a host share; CRIU's parasite mounts a private /proc there under a fixed name, so
the ranks' dumps take turns to start, and a later collision makes an incremental dump (which
cannot be redone) fall back to a whole one (proc/procwindow.py).  Each pair runs the default
evacuation of bench/compare.py's reference job (512 MiB of state per rank, 4 GiB prewarm) once
with the init switched off (PITSTOP_INIT naming no file: `pitstop run` then starts the command
as the namespace's init) and once with it: 2 leaving ranks of a 4-rank job, then 4 leaving ranks
of an 8-rank job.  Reports downtime, the pause the job saw, the capture phase and who cut each
rank's delta (CRIU's incremental dump, or pitstop after a whole dump).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ab_summary, write_ab  # noqa: E402
from bench.compare import OUT, _evacuation_once  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs-2", type=int, default=3, help="pairs with 2 leaving ranks (4-rank job)")
    ap.add_argument("--pairs-4", type=int, default=2, help="pairs with 4 leaving ranks (8-rank job)")
    ap.add_argument("--out", default=str(OUT / "init-ab.json"))
    a = ap.parse_args()
    runs = []
    plan = [(4, [2, 3])] * a.pairs_2 + [(8, [4, 5, 6, 7])] * a.pairs_4
    for world, leaving in plan:
        for mode in ("off", "on"):
            if mode == "off":
                os.environ["PITSTOP_INIT"] = "/nonexistent/pitstop-init"
            else:
                os.environ.pop("PITSTOP_INIT", None)
            r = _evacuation_once(world, leaving, 512, 300, None, "pitstop", 4, None)
            caps = r["capture_phases"]
            runs.append({"init": mode, "world": world, "leaving": len(leaving), "downtime_s": r["downtime_s"],
                         "job_pause_s": r["job_pause_s"], "phases": r["phases"], "capture_phases": caps,
                         "pre_copy_by": r["pre_copy_by"], "ranks_agree": r["first_divergent_step"] is None})
            print(f"init {mode:<3} {len(leaving)} of {world} ranks leaving: downtime {r['downtime_s']:.2f} s, "
                  f"job pause {r['job_pause_s']:.2f} s, capture {r['phases']['capture']:.2f} s, "
                  f"dumps {[round(c.get('dump', 0), 2) for c in caps]}, delta by {r['pre_copy_by']}", flush=True)
    summary = ab_summary(runs, "init", sorted({w for w, _ in plan}), ["off", "on"], {
        "median_downtime_s": lambda x: [x["downtime_s"]], "median_job_pause_s": lambda x: [x["job_pause_s"]],
        "median_capture_s": lambda x: [x["phases"]["capture"]]})
    write_ab(Path(a.out), summary, runs)


if __name__ == "__main__":
    main()

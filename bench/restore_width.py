"""The restore at the spare's width: 1, 2, 4 and 8 leaving ranks restored at once.

    .venv/bin/python bench/restore_width.py [--leaving 1,2,4,8] [--state-mb 256] [--repeats 1]
        [--out bench/out/restore-width.json]

A spare is idle while it restores, so a host's ranks should restore side by side at its cores'
width: the per-host rate should grow with the ranks until the cores, the memory bandwidth or the
disk run out.  Each run evacuates a job of 2 x N ranks (bench/compare.py's reference DDP job,
N of them on the leaving host) by stop-and-copy, so that every leaving byte is restored in the
pause, and reports, per size: CRIU's restore of each rank (its own rate: its image over its
restore) and the restore phase of the whole host (the host's rate: every leaving byte over the
phase).  Run on the machine whose width you want to know: on the 2-core test VM the host's rate
stops growing at 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine  # noqa: E402
from bench.compare import OUT, _evacuation_once  # noqa: E402


def one(n: int, state_mb: float) -> dict:
    world = 2 * n
    leaving = list(range(n, world))
    r = _evacuation_once(world, leaving, state_mb, 400, None, "pitstop, stop-and-copy", 0, False)
    moved = r["bytes_before_resume"]
    per_rank_bytes = moved / n
    criu = [p.get("criu_restore", 0.0) for p in r["restore_phases"]]
    phase = r["phases"]["restore"]
    return {"leaving": n, "world": world, "state_mb": state_mb, "bytes": moved, "restore_phase_s": phase,
            "criu_restore_s": criu, "per_rank_GBps": [round(per_rank_bytes / c / 1e9, 3) for c in criu if c],
            "host_GBps": round(moved / phase / 1e9, 3), "downtime_s": r["downtime_s"],
            "ranks_agree": r["first_divergent_step"] is None, "final_hashes_equal": len(set(r["final"])) == 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leaving", default="1,2,4,8", help="leaving ranks per run, comma-separated")
    ap.add_argument("--state-mb", type=float, default=256.0, help="extra state per rank")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=str(OUT / "restore-width.json"))
    a = ap.parse_args()
    sizes = [int(x) for x in a.leaving.split(",")]
    if any(not 1 <= n <= 16 for n in sizes):
        raise SystemExit(f"--leaving takes 1 to 16 ranks; got {a.leaving}")
    runs = []
    for _ in range(a.repeats):
        for n in sizes:
            r = one(n, a.state_mb)
            runs.append(r)
            print(f"{n} leaving: restore phase {r['restore_phase_s']:.2f} s for {r['bytes'] / 1e9:.2f} GB, host "
                  f"{r['host_GBps']:.2f} GB/s; per rank {r['per_rank_GBps']} GB/s; downtime {r['downtime_s']:.2f} s; "
                  f"bitwise {r['final_hashes_equal'] and r['ranks_agree']}", flush=True)
    summary = {n: {"host_GBps": statistics.median(r["host_GBps"] for r in runs if r["leaving"] == n),
                   "per_rank_GBps": statistics.median(x for r in runs if r["leaving"] == n for x in r["per_rank_GBps"])}
               for n in sizes}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                               "state_mb": a.state_mb, "runs": runs, "summary": summary}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

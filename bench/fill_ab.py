"""CRIU's restore filling memory with UFFDIO_COPY (native/criufill.c), on and off, interleaved.

    .venv/bin/python bench/fill_ab.py [--pairs 3] [--worlds 4,2] [--out bench/out/fill-ab.json]

Without the library, CRIU reads each rank's pages into premapped memory: one page fault per
4 KiB page, each page zeroed by the kernel before the copy overwrites it.  With it, the same
reads become UFFDIO_COPY calls that neither fault nor zero.  Each pair runs the default
evacuation of bench/compare.py's reference job (512 MiB of state per rank, 4 GiB prewarm)
once with PITSTOP_AGENT_RESTORE_UFFD_FILL=false and once with it true (or, with `--modes on1,on`,
with one copying thread against as many as the CPUs), the order alternating from pair to pair: for a 4-rank job 2 ranks leave (two restores at once on the spare), for a
2-rank job one.  Reports downtime, the pause the job saw, the restore phase, CRIU's restore per
rank and the bytes the library filled (which must be the image's, for the "on" runs to count).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ab_parser, ab_run, ab_summary, write_ab  # noqa: E402
from bench.compare import OUT, _evacuation_once  # noqa: E402

LEAVING = {2: [1], 4: [2, 3], 8: [4, 5, 6, 7]}
MODES = {"off": {"PITSTOP_AGENT_RESTORE_UFFD_FILL": "false"}, "on": {"PITSTOP_AGENT_RESTORE_UFFD_FILL": "true"},
         "on1": {"PITSTOP_AGENT_RESTORE_UFFD_FILL": "true", "PITSTOP_CRIUFILL_THREADS": "1"}}


def main() -> None:
    ap = ab_parser(__doc__, "4,2", OUT / "fill-ab.json")
    ap.add_argument("--modes", default="off,on",
                    help="the two ways to compare, among off, on (threads as the CPUs) and on1 (one thread)")
    a = ap.parse_args()
    worlds = [int(w) for w in a.worlds.split(",")]
    modes = a.modes.split(",")
    if len(modes) != 2 or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes takes two of {sorted(MODES)}; got {a.modes}")
    if any(w not in LEAVING for w in worlds):
        raise SystemExit(f"--worlds takes sizes among {sorted(LEAVING)}; got {a.worlds}")
    runs = []
    for i in range(a.pairs):
        for world in worlds:
            for mode in (modes if i % 2 == 0 else modes[::-1]):
                env = MODES[mode]
                r = _evacuation_once(world, LEAVING[world], a.state_mb, 300, env, "pitstop", 4, None)
                rp = r["restore_phases"]
                filled = sum(int(p.get("uffd_fill_bytes", 0)) for p in rp)
                left = sum(int(p.get("uffd_fill_left_bytes", 0)) for p in rp)
                crit = [round(p.get("criu_restore", 0.0), 3) for p in rp]
                runs.append({"fill": mode, **ab_run(r), "leaving": len(LEAVING[world]), "criu_restore_s": crit,
                             "uffd_fill_bytes": filled, "uffd_fill_left_bytes": left,
                             "bytes_pre_copied": r["bytes_pre_copied"], "pre_copy_by": r["pre_copy_by"]})
                print(f"fill {mode:<3} {len(LEAVING[world])} of {world} ranks leaving: downtime {r['downtime_s']:.2f} s, "
                      f"job pause {r['job_pause_s']:.2f} s, restore {r['phases']['restore']:.2f} s, "
                      f"CRIU restore {crit}, filled {filled / 1e6:.0f} MB (left {left / 1e6:.0f} MB), "
                      f"ranks agree {runs[-1]['ranks_agree']}", flush=True)
    summary = ab_summary(runs, "fill", worlds, modes, {
        "median_downtime_s": lambda x: [x["downtime_s"]], "median_job_pause_s": lambda x: [x["job_pause_s"]],
        "median_restore_s": lambda x: [x["phases"]["restore"]], "median_criu_restore_s": lambda x: x["criu_restore_s"]})
    write_ab(Path(a.out), summary, runs)


if __name__ == "__main__":
    main()

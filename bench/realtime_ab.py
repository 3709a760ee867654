"""The pause and resume rounds on SCHED_FIFO (pitstop/priority.py), on and off, interleaved.

    .venv/bin/python bench/realtime_ab.py [--pairs 3] [--worlds 8,2] [--steps 300] [--prewarm-gib 4]
                                          [--out bench/out/realtime-ab.json]

What grows with the job in the scaling runs is the control rounds: with 8 ranks on 2 cores the
coordinator's pause round took 0.03-0.09 s and its resume round 0.02-0.04 s, against 0.01-0.02
and 0.005 s at 2 ranks.  Each run is the scaling case of bench/compare.py (one rank of 512 MiB
state leaving, the others on host-a, 4 GiB prewarm, pre-copy) with agents and coordinator
allowed the boost (default) or not (PITSTOP_AGENT_REALTIME=false, PITSTOP_COORDINATOR_REALTIME=
false: nice -10 alone, as before), the order alternating from pair to pair.  Reports downtime,
the pause the job saw, the pause and resume phases and the restore.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ab_parser, write_ab  # noqa: E402
from bench.compare import OUT  # noqa: E402
from bench.setting_ab import run, summary  # noqa: E402

MODES = {"off": {"PITSTOP_AGENT_REALTIME": "false", "PITSTOP_COORDINATOR_REALTIME": "false"},
         "on": {"PITSTOP_AGENT_REALTIME": "true", "PITSTOP_COORDINATOR_REALTIME": "true"}}


def main() -> None:
    ap = ab_parser(__doc__, "8,2", OUT / "realtime-ab.json")
    ap.add_argument("--steps", type=int, default=300,
                    help="the job's steps: more where a slow prewarm would outlast them (8 ranks on 2 cores)")
    ap.add_argument("--prewarm-gib", type=float, default=4.0)
    a = ap.parse_args()
    worlds = [int(w) for w in a.worlds.split(",")]
    if any(w < 2 for w in worlds):
        raise SystemExit(f"--worlds: every job needs 2 ranks or more (one stays, one leaves); got {a.worlds}")
    runs = run(MODES, worlds, a.pairs, a.state_mb, a.steps, a.prewarm_gib, label="realtime")
    write_ab(Path(a.out), summary(runs, list(MODES), worlds, label="realtime"), runs)


if __name__ == "__main__":
    main()

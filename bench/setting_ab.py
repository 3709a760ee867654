"""One agent or coordinator setting two ways, whole moves interleaved: which is faster, in the same run.

    .venv/bin/python bench/setting_ab.py --arm wait PITSTOP_AGENT_RELEASE_WAIT_EXIT=true \\
        --arm let-go PITSTOP_AGENT_RELEASE_WAIT_EXIT=false [--pairs 3] [--worlds 8,2] [--steps 600]
        [--prewarm-gib 2] [--out bench/out/setting-ab.json]

Each run is the scaling case of bench/compare.py (one rank of 512 MiB state leaving a job of
N ranks, pre-copy, prewarm), the services started with one arm's settings; the arms' order
alternates from pair to pair, so that the machine's drift within the hour falls on both.
Reports downtime, the pause the job saw, every phase and CRIU's restore per rank, and checks
that the ranks stayed bitwise in step (a run whose ranks disagree is no evidence for either arm).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import ab_parser, ab_run, ab_summary, write_ab  # noqa: E402
from bench.compare import OUT, evacuation  # noqa: E402

PHASES = ("pause", "capture", "release", "restore", "resume")


def _arm(text: list[str]) -> tuple[str, dict[str, str]]:
    """`--arm NAME K=V [K=V...]`: the arm's name and the settings its services get."""
    name, *pairs = text
    env = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.startswith("PITSTOP_"):
            raise SystemExit(f"--arm {name}: {p!r} is not PITSTOP_NAME=VALUE; pass settings like "
                             "PITSTOP_AGENT_REALTIME=false")
        env[k] = v
    return name, env


def run(arms: dict[str, dict[str, str]], worlds: list[int], pairs: int, state_mb: float, steps: int,
        prewarm_gib: float, label: str = "arm") -> list[dict]:
    """The interleaved runs: every arm once per pair and job size, the order turning each pair."""
    names = list(arms)
    runs = []
    for i in range(pairs):
        for world in worlds:
            for name in (names if i % 2 == 0 else names[::-1]):
                r = evacuation(world, [world - 1], state_mb, steps, arms[name], "pitstop", prewarm_gib)
                runs.append({label: name, **ab_run(r), "pause_round_s": r["pause_round_s"],
                             "criu_restore_s": [round(x.get("criu_restore", 0.0), 3) for x in r["restore_phases"]],
                             "attempts": r["attempts"], "near_the_end": r.get("near_the_end", False)})
                p = r["phases"]
                print(f"{label} {name:<8} {world} ranks: downtime {r['downtime_s']:.3f} s, job pause "
                      f"{r['job_pause_s']:.2f} s, " + ", ".join(f"{k} {p[k]:.3f}" for k in PHASES if k in p)
                      + f", ranks agree {runs[-1]['ranks_agree']}", flush=True)
    return runs


def summary(runs: list[dict], arms: list[str], worlds: list[int], label: str = "arm") -> dict:
    return ab_summary(runs, label, worlds, arms, {
        "median_downtime_s": lambda x: [x["downtime_s"]], "median_job_pause_s": lambda x: [x["job_pause_s"]],
        **{f"median_{k}_s": (lambda x, k=k: [x["phases"][k]] if k in x["phases"] else []) for k in PHASES}})


def main() -> None:
    ap = ab_parser(__doc__, "8,2", OUT / "setting-ab.json")
    ap.add_argument("--arm", nargs="+", action="append", required=True, metavar=("NAME", "SETTING"),
                    help="an arm's name and its settings (PITSTOP_...=VALUE); give two")
    ap.add_argument("--steps", type=int, default=600,
                    help="the job's steps: enough that a slow prewarm beside 8 ranks does not outlast them")
    ap.add_argument("--prewarm-gib", type=float, default=2.0)
    a = ap.parse_args()
    arms = dict(_arm(x) for x in a.arm)
    if len(arms) != 2:
        raise SystemExit(f"--arm: give two arms with different names; got {list(arms) or 'none'}")
    worlds = [int(w) for w in a.worlds.split(",")]
    if any(w < 2 for w in worlds):
        raise SystemExit(f"--worlds: every job needs 2 ranks or more (one stays, one leaves); got {a.worlds}")
    runs = run(arms, worlds, a.pairs, a.state_mb, a.steps, a.prewarm_gib)
    write_ab(Path(a.out), summary(runs, list(arms), worlds), runs)


if __name__ == "__main__":
    main()

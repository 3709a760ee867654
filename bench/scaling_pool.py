"""How well the scaling target can be resolved at all: the moves of many scaling runs, pooled.

    .venv/bin/python bench/scaling_pool.py docs/img/scaling-2026-12-03*.json [--out FILE]

Issue 7 asks that the downtime change by at most 10 % from 2 to 8 ranks.  Each run of
`bench/compare.py --scaling-only` gives 1 to 5 moves per size, and on the test VM a single
move's downtime varies by +-30 % with the state of the machine's memory, so one run's spread of
medians moves from 4 % to 23 % between runs of the same code.  This reads the runs already
recorded (any JSON with a `scaling` list of moves, as compare.py writes) and says:
- each run's ratio of medians, largest size to smallest;
- the pooled ratio: the runs' ratios combined, each weighted by how many moves it holds (see
  pooled()), with a 95 % interval from a bootstrap that resamples moves within each run;
- which phases make the difference (medians per size);
- how many moves per size a single run would need for its interval to be narrower than the
  target itself (+-5 points), at the noise these moves show.
Nothing is run: the figures come from the files named, and say which they are.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path
from typing import Iterable

METHOD = "pitstop, 1 rank leaving"
PHASES = ("capture", "release", "restore", "resume")
BOOT = 4000


def moves(path: Path) -> list[dict]:
    """The default method's moves of one run (post-copy's are another method)."""
    d = json.loads(path.read_text())
    return [m for m in d.get("scaling") or [] if m.get("method") == METHOD and m.get("downtime_s")]


def ratio(rs: list[dict], lo: int, hi: int) -> float | None:
    a = [m["downtime_s"] for m in rs if m["world"] == lo]
    b = [m["downtime_s"] for m in rs if m["world"] == hi]
    return statistics.median(b) / statistics.median(a) - 1 if a and b else None


def pooled(runs: list[list[dict]], lo: int, hi: int) -> float:
    """The runs' ratios combined: a weighted mean of their logarithms, each run weighted by
    1 / (1/n_lo + 1/n_hi) (the inverse of its ratio's variance, where every move is as noisy).
    Not the ratio of the medians of all moves together: runs differ in level (code, day, the
    machine's memory: 0.39 s a move in one, 0.60 s in another) and in how many moves of each
    size they hold, and pooled raw moves would turn those differences into a size effect."""
    num = den = 0.0
    for rs in runs:
        n_lo = sum(m["world"] == lo for m in rs)
        n_hi = sum(m["world"] == hi for m in rs)
        w = 1.0 / (1.0 / n_lo + 1.0 / n_hi)
        num += w * math.log1p(ratio(rs, lo, hi))
        den += w
    return math.expm1(num / den)


def bootstrap(runs: list[list[dict]], lo: int, hi: int, rng: random.Random) -> tuple[float, float]:
    """95 % interval of the pooled ratio, resampling each run's moves of each size."""
    out = []
    for _ in range(BOOT):
        again = []
        for rs in runs:
            x = [m for m in rs if m["world"] == lo]
            y = [m for m in rs if m["world"] == hi]
            again.append([rng.choice(x) for _ in x] + [rng.choice(y) for _ in y])
        out.append(pooled(again, lo, hi))
    out.sort()
    return out[int(0.025 * BOOT)], out[int(0.975 * BOOT)]


def within_run(runs: Iterable[list[dict]], world: int) -> list[float]:
    """Each move of `world` ranks over its own run's median for that size: the noise one run
    sees, without the differences between runs (days, code, the machine's memory)."""
    out: list[float] = []
    for rs in runs:
        x = [m["downtime_s"] for m in rs if m["world"] == world]
        if len(x) >= 2:
            med = statistics.median(x)
            out += [v / med for v in x]
    return out


def needed(pool_lo: list[float], pool_hi: list[float], rng: random.Random, width: float = 0.10) -> int | None:
    """Moves per size for one run's 95 % interval of the ratio to be narrower than `width`,
    drawing moves from the within-run noise measured (`within_run`)."""
    for n in (3, 5, 9, 15, 25, 40, 60, 100):
        rs = []
        for _ in range(1000):
            a = [rng.choice(pool_lo) for _ in range(n)]
            b = [rng.choice(pool_hi) for _ in range(n)]
            rs.append(statistics.median(b) / statistics.median(a))
        rs.sort()
        if rs[974] - rs[25] < width:
            return n
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="write the summary as JSON here too")
    ap.add_argument("--seed", type=int, default=7)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    runs = {str(f): moves(f) for f in a.files}
    runs = {f: rs for f, rs in runs.items() if rs}
    if not runs:
        sys.exit("none of the files holds a scaling move of the default method; name compare.py's JSON files")
    worlds = sorted({m["world"] for rs in runs.values() for m in rs})
    lo, hi = worlds[0], worlds[-1]
    both = [rs for rs in runs.values() if ratio(rs, lo, hi) is not None]
    every = [m for rs in runs.values() for m in rs]
    summary: dict = {"files": list(runs), "sizes": worlds, "moves": {str(w): sum(m["world"] == w for m in every)
                                                                     for w in worlds}}
    summary["per_run_ratio"] = {f: round(r, 3) for f, rs in runs.items() if (r := ratio(rs, lo, hi)) is not None}
    summary["pooled_ratio"] = round(pooled(both, lo, hi), 3)
    summary["pooled_ratio_ci95"] = [round(x, 3) for x in bootstrap(both, lo, hi, rng)]
    summary["median_downtime_s"] = {str(w): round(statistics.median(m["downtime_s"] for m in every if m["world"] == w), 3)
                                    for w in worlds}
    summary["median_phase_s"] = {str(w): {p: round(statistics.median(m["phases"].get(p, 0.0) for m in every
                                                                      if m["world"] == w), 4) for p in PHASES}
                                 for w in worlds}
    pool_lo, pool_hi = within_run(runs.values(), lo), within_run(runs.values(), hi)
    summary["within_run_spread"] = {str(w): [round(min(p), 3), round(max(p), 3)]
                                    for w, p in ((lo, pool_lo), (hi, pool_hi))}
    summary["moves_per_size_for_a_10_point_interval"] = needed(pool_lo, pool_hi, rng)
    print(f"{len(runs)} runs, moves per size {summary['moves']}; {hi} ranks against {lo}:")
    for f, r in summary["per_run_ratio"].items():
        print(f"  {Path(f).name:<44} {r:+.1%}")
    c = summary["pooled_ratio_ci95"]
    print(f"  pooled: {summary['pooled_ratio']:+.1%} (95 % interval {c[0]:+.1%} to {c[1]:+.1%})")
    for w in worlds:
        ph = summary["median_phase_s"][str(w)]
        print(f"  {w} ranks: median downtime {summary['median_downtime_s'][str(w)]:.3f} s; "
              + ", ".join(f"{p} {v:.3f}" for p, v in ph.items()))
    n = summary["moves_per_size_for_a_10_point_interval"]
    sp = summary["within_run_spread"]
    print(f"  one run's moves lie between {sp[str(lo)][0]:.2f} and {sp[str(lo)][1]:.2f} x its median at {lo} ranks, "
          f"{sp[str(hi)][0]:.2f} and {sp[str(hi)][1]:.2f} x at {hi}")
    print(f"  moves per size for a single run's 95 % interval under 10 points: {n or 'more than 100'}")
    if a.out:
        a.out.write_text(json.dumps(summary, indent=1))
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()

"""A worker that writes stdout and stderr in one known order: per step, a burst of lines that
alternate between the two streams (`out S.K` then `err S.K`), each written and flushed on its own.
A plain run into one file (`>log 2>&1`) holds them in exactly that order; a relay through two
pipes copies each burst's stdout and stderr apart.  It sleeps after each step (a pace file
changes the sleep while it runs, tests/workloads/pace.py), so a test can move it mid-run."""

from __future__ import annotations

import argparse
import sys

from pace import pause


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--burst", type=int, default=20, help="lines per stream per step")
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--pace-file")
    args = p.parse_args()
    for s in range(args.steps):
        for k in range(args.burst):
            sys.stdout.write(f"out {s}.{k}\n")
            sys.stdout.flush()
            sys.stderr.write(f"err {s}.{k}\n")
            sys.stderr.flush()
        pause(args.step_sleep, args.pace_file)


if __name__ == "__main__":
    main()

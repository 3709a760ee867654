"""Shared plumbing of the NCCL workloads: arguments, step lines, the final hash."""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import numpy as np
from pace import pause as _pause


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--pace-file", help="a file whose number, read at every step, replaces --step-sleep "
                                       "(a test slows the job while it needs it running, then lets it finish)")
    p.add_argument("--rendezvous", required=True, help="shared directory for the unique ids")
    p.add_argument("--out", required=True)
    p.add_argument("--stall-rank", type=int, default=-1, help="this rank computes for --stall-seconds ...")
    p.add_argument("--stall-at", type=int, default=-1, help="... at this step, calling no NCCL at all")
    p.add_argument("--stall-seconds", type=float, default=0.0)
    a = p.parse_args()
    a.rank, a.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    global _args
    _args = a
    return a


_args: argparse.Namespace | None = None


def pause(a: argparse.Namespace) -> None:
    """The sleep between steps: --step-sleep, or the number in --pace-file once it exists."""
    _pause(a.step_sleep, a.pace_file)


def step_line(step: int, value: float) -> None:
    print(f"step {step} t={time.time():.6f} loss={value:.6f}", flush=True)
    if _args is not None and _args.rank == _args.stall_rank and step == _args.stall_at:
        print(f"stalling for {_args.stall_seconds} s", flush=True)
        end = time.time() + _args.stall_seconds
        while time.time() < end:  # busy in compute: never reaches an NCCL call
            pass


def finish(a: argparse.Namespace, *arrays: np.ndarray) -> None:
    os.makedirs(a.out, exist_ok=True)
    h = hashlib.sha256(b"".join(np.ascontiguousarray(x).tobytes() for x in arrays)).hexdigest()
    with open(os.path.join(a.out, f"rank{a.rank}.sha256"), "w") as f:
        f.write(h + "\n")
    print(f"done rank={a.rank} sha256={h}", flush=True)

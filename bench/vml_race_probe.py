"""Probe for the MKL VML first-call race behind the former gloo divergence (pytorch/pytorch#188792).

Each trial is a fresh child, forked after torch's import and before any MKL VML call, that
takes torch.sqrt of the same 16384 floats twice on THREADS intra-op threads (the size and
the op of Adam's first update of ddp_train's first weight).  The first call is where
oneMKL 2024.2 picks its kernel; a thread that loses the race computes its chunk with the
low-accuracy kernel, so the two calls differ.  With --warm the child first runs the job's
warm-up (tests/workloads/ddp_train.py, warm_mkl_vml), and the calls must agree every time.
The OpenMP pool and MKL's BLAS are started first, as a training step would have.
Not a benchmark: a diagnostic, run on demand.

    .venv/bin/python bench/vml_race_probe.py --trials 3000 --threads 8 [--warm] [--burners 2]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "workloads"))
from ddp_train import warm_mkl_vml  # noqa: E402


def trial(x: torch.Tensor, warm: bool) -> str:
    """Run in the forked child: '<elements that differ> <first> <last>'."""
    torch.ones(1 << 20).add_(1)  # the OpenMP pool exists, as after a forward pass
    torch.randn(16, 64) @ torch.randn(64, 256)  # and MKL's BLAS has run
    if warm:
        warm_mkl_vml()
    a, b = torch.sqrt(x), torch.sqrt(x)
    bad = (a != b).nonzero().reshape(-1)
    return f"{bad.numel()} {int(bad[0]) if bad.numel() else -1} {int(bad[-1]) if bad.numel() else -1}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=1000)
    p.add_argument("--threads", type=int, default=8, help="intra-op threads (more threads: more racers)")
    p.add_argument("--warm", action="store_true", help="run ddp_train's warm-up first")
    p.add_argument("--burners", type=int, default=0, help="busy processes beside the probe")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.rand(16384, generator=torch.Generator().manual_seed(0)) * 1e-5 + 1e-9
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    bad, t0 = 0, time.time()
    try:
        for i in range(args.trials):
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns into the loop
                os.close(r)
                try:
                    os.write(w, trial(x, args.warm).encode())
                finally:
                    os._exit(0)
            os.close(w)
            out = os.read(r, 100).decode()
            os.close(r)
            os.waitpid(pid, 0)
            n, first, last = out.split() if out else ("child died", "", "")
            if n != "0":
                bad += 1
                print(f"trial {i}: first call differs from the second in {n} elements ({first}..{last})", flush=True)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    print(f"{args.trials} trials, {bad} with a wrong first sqrt, threads={args.threads} warm={args.warm} "
          f"burners={args.burners}, {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()

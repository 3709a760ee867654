"""A plain torch DDP training job (gloo) with no pitstop code in it.

The tests and benches move its ranks between hosts and compare the final
parameters with an uninterrupted run, bit for bit.  Configuration comes from
the usual torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) plus a few flags.  Each step prints one line
``step N t=<unix time> loss=<float>`` so that a harness can see the pause as
the job sees it (the gap between consecutive step lines).
"""

from __future__ import annotations

import time

T_START = time.time()  # before torch's import: a relaunch's start-up is part of checkpoint-restart's cost

import argparse
import ctypes
import faulthandler
import hashlib
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from pace import pause
from torch.nn.parallel import DistributedDataParallel as DDP

ABORT_TRACE = Path(__file__).resolve().parents[2] / "native" / "build" / "libpitstop_aborttrace.so"


# The float functions ATen hands to MKL's vector math library (VML) on x86 builds
# (aten/src/ATen/cpu/vml.h, IMPLEMENT_VML_MKL).
_VML_OPS = (torch.acos, torch.asin, torch.atan, torch.cos, torch.erf, torch.erfc, torch.erfinv, torch.exp,
            torch.log, torch.log10, torch.log2, torch.sin, torch.sqrt, torch.tan, torch.tanh, torch.trunc)


def warm_mkl_vml() -> None:
    """Resolve MKL VML's kernels on this one thread, before any op runs on several.

    The oneMKL 2024.2 bundled with torch's CPU wheels picks each VML function's kernel at
    its first call; when that first call runs on several intra-op threads at once, one of
    them can compute its whole chunk with the low-accuracy AVX2 "EP" kernel although high
    accuracy was asked for (pytorch/pytorch#188792).  In this job that first call is Adam's
    sqrt in step 1: under CPU load, about one fresh process in a few hundred took a
    different first update on one rank and the ranks' parameters parted for good (matched
    bit for bit: docs/reliability.md).  One call on a 1-element tensor, which runs on the
    calling thread only, settles every kernel first.  A relaunched job (checkpoint-restart)
    is a fresh process and needs it again; a restored one keeps MKL's state."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for op in _VML_OPS:
            op(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--state-mb", type=float, default=0.0, help="extra resident state per rank (MiB)")
    p.add_argument("--state-kind", choices=["arange", "randn"], default="arange",
                   help="what the extra state holds: int32 counting up (compresses to about 2/3 with zstd) or "
                        "normal float32 like freshly initialised weights (about 0.92): bench/compress_link.py")
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--pace-file", help="a file whose number, read at every step, replaces --step-sleep "
                                       "(a test slows the job while it needs it running, then lets it finish)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--out", required=True, help="directory for rank<N>.pt and rank<N>.sha256")
    p.add_argument("--trace-params", action="store_true",
                   help="print a digest of the parameters every step (also to --out/trace-rank<N>.txt)")
    p.add_argument("--save-at-step", type=int, default=0,
                   help="checkpoint-restart baseline: after this step torch.save everything to --ckpt and exit")
    p.add_argument("--ckpt", help="directory for the checkpoint (--save-at-step, --resume)")
    p.add_argument("--resume", action="store_true", help="load the checkpoint in --ckpt and continue from it")
    args = p.parse_args()

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # A rank has been seen, rarely, to abort at exit ("terminate called without an active
    # exception", docs/reliability.md) after its final hash: let the next one print where it
    # was, in Python (faulthandler, every thread) and then the aborting thread's native stack
    # (native/aborttrace.c, loaded first: faulthandler hands the signal on to it).
    if ABORT_TRACE.exists():
        ctypes.CDLL(str(ABORT_TRACE))
    faulthandler.enable(all_threads=True)
    warm_mkl_vml()
    print(f"phase start t={T_START:.6f}", flush=True)
    print(f"phase imported t={time.time():.6f}", flush=True)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    print(f"phase group t={time.time():.6f}", flush=True)
    torch.manual_seed(1234)
    torch.use_deterministic_algorithms(True)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 8))
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    # Ballast: state that must survive the move like any other memory.
    n = int(args.state_mb * 262144)
    ballast = None if not n else (torch.arange(n, dtype=torch.int32) if args.state_kind == "arange"
                                  else torch.randn(n, generator=torch.Generator().manual_seed(7 + rank)))

    g = torch.Generator().manual_seed(100 + rank)
    data = torch.randn(args.steps * 16, 64, generator=g)
    target = torch.randn(args.steps * 16, 8, generator=g)
    ds = torch.utils.data.TensorDataset(data, target)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=False, num_workers=args.workers,
                                         persistent_workers=args.workers > 0)
    step = 0
    ckpt = os.path.join(args.ckpt, f"rank{rank}.ckpt") if args.ckpt else None
    if args.resume:
        saved = torch.load(ckpt)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        ballast, step = saved["ballast"], saved["step"]
        print(f"phase loaded t={time.time():.6f}", flush=True)
    batches = iter(loader)
    for _ in range(step):  # the loader is not shuffled: skipping is exact
        next(batches)
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        step += 1
        print(f"step {step} t={time.time():.6f} loss={loss.item():.6f}", flush=True)
        if args.trace_params:
            d = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
            print(f"params {step} {d}", flush=True)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"trace-rank{rank}.txt"), "a") as f:  # no fd kept open across a move
                f.write(f"{step} {d}\n")
            if step == 1:  # the first update is where MKL's first-call race showed (docs/reliability.md)
                torch.save({"params": [p.detach().clone() for p in model.parameters()],
                            "grads": [p.grad.detach().clone() for p in model.parameters()]},
                           os.path.join(args.out, f"trace-rank{rank}-step1.pt"))
        if step == args.save_at_step:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "ballast": ballast, "step": step}, ckpt)
            print(f"phase saved t={time.time():.6f}", flush=True)
            dist.barrier()  # every rank's checkpoint is on disk before any rank leaves
            dist.destroy_process_group()
            return
        pause(args.step_sleep, args.pace_file)
    if ballast is not None and args.state_kind == "arange":
        n = ballast.numel()
        assert int(ballast[-1]) == n - 1 and int(ballast[n // 2]) == n // 2, "ballast corrupted"
        assert int(ballast.sum(dtype=torch.int64)) == n * (n - 1) // 2, "ballast corrupted"
    elif ballast is not None:  # the same draw again: every element must have survived
        again = torch.randn(ballast.numel(), generator=torch.Generator().manual_seed(7 + rank))
        assert torch.equal(ballast, again), "ballast corrupted"
    os.makedirs(args.out, exist_ok=True)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, os.path.join(args.out, f"rank{rank}.pt"))
    h = hashlib.sha256(b"".join(v.numpy().tobytes() for v in state.values())).hexdigest()
    with open(os.path.join(args.out, f"rank{rank}.sha256"), "w") as f:
        f.write(h + "\n")
    print(f"done rank={rank} steps={step} sha256={h}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's finalization.  A gloo worker thread (ProcessGroupGloo::runLoop)
    # can still run a Python callback then; CPython 3.11 makes a thread that takes the GIL during
    # finalization call pthread_exit, whose forced unwind meets a noexcept frame in torch:
    # std::terminate, "terminate called without an active exception", exit 134 after the job's last
    # line (native stack traced by native/aborttrace.c, docs/reliability.md).  Everything the job
    # writes is written and flushed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

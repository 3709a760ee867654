"""A deterministic CUDA training loop (no pitstop code): the workload of tests/gpu.

--pg nccl  wraps the gradient in a ProcessGroupNCCL allreduce (world size 1);
--hold-gib N  only allocates N GiB on the GPU, prints its checksum, waits for
a line on stdin, and prints the checksum again (the throughput check).
--cuda-children N  also runs the same loop in N child processes (a worker tree of several CUDA
processes, as a launcher holding its ranks makes one) and, at the end, prints "children agree"
when each child's final parameters equal its own.  The parent's first step waits until every
child has its CUDA context, so a pause after step 1 finds three CUDA processes (before
2026-12-04 17:00 the children could still be importing torch at the pause).
Prints "step N ..." per step and "done sha256=..." of the final parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--step-sleep", type=float, default=0.01)
p.add_argument("--pg", choices=["none", "nccl"], default="none")
p.add_argument("--hold-gib", type=float, default=0.0)
p.add_argument("--device", default="cuda", help="cpu: exercise the harness on a machine without a GPU")
p.add_argument("--cuda-children", type=int, default=0, help="the same loop in this many child processes too")
p.add_argument("--quiet", action="store_true", help="print only the final line (the children)")
p.add_argument("--cache-gib", type=float, default=0.0,
               help="each step also fills and frees a temporary of this many GiB, as large activations do: "
                    "PyTorch's caching allocator keeps it reserved between steps (check g)")
a = p.parse_args()
children = []
if a.cuda_children:
    import subprocess

    if a.pg != "none" or a.hold_gib:
        p.error("--cuda-children goes with the plain training loop only")
    own = ["--steps", str(a.steps), "--step-sleep", str(a.step_sleep), "--device", a.device, "--quiet"]
    children = [subprocess.Popen([sys.executable, __file__, *own], stdout=subprocess.PIPE, text=True)
                for _ in range(a.cuda_children)]

dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device(a.device)
if a.hold_gib:
    n = int(a.hold_gib * 2**30) // 4
    buf = torch.arange(n, dtype=torch.int32, device=dev)
    buf.mul_(2654435761 & 0x7FFFFFFF)
    print(f"holding {a.hold_gib} GiB checksum={int(buf.sum(dtype=torch.int64))}", flush=True)
    sys.stdin.readline()
    print(f"after checksum={int(buf.sum(dtype=torch.int64))}", flush=True)
    sys.exit(0)

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
torch.use_deterministic_algorithms(True)
torch.manual_seed(1234)
pg = None
if a.pg == "nccl":
    import torch.distributed as dist

    store = dist.FileStore(os.environ["PG_STORE"], 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16)).to(dev)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
g = torch.Generator(device=dev).manual_seed(99)
if a.quiet:  # a child: its CUDA context exists now
    print("ready", flush=True)
for c in children:  # every process of the tree holds CUDA before the first step (and so at any pause)
    line = c.stdout.readline().strip()  # type: ignore[union-attr]
    if line != "ready":
        print(f"a child did not start: {line!r}", flush=True)
        sys.exit(1)
for step in range(1, a.steps + 1):
    x = torch.randn(256, 512, device=dev, generator=g)
    y = torch.randn(256, 16, device=dev, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    if a.pg == "nccl":
        for prm in model.parameters():
            dist.all_reduce(prm.grad)  # SUM over one rank: the same values, through NCCL
    opt.step()
    if a.cache_gib:  # freed at once, kept reserved by the caching allocator: no effect on the results
        tmp = torch.empty(int(a.cache_gib * 2**30) // 4, dtype=torch.float32, device=dev)
        tmp.fill_(float(step))
        del tmp
    if not a.quiet:
        print(f"step {step} t={time.time():.6f} loss={loss.item():.6f}", flush=True)
    time.sleep(a.step_sleep)
h = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes() for t in model.parameters())).hexdigest()
if a.pg == "nccl":
    dist.destroy_process_group()
if children:
    got = [c.communicate(timeout=600)[0].strip() for c in children]
    if any(c.returncode != 0 for c in children) or any(x != f"done sha256={h}" for x in got):
        print(f"children differ: {got} (exit {[c.returncode for c in children]})", flush=True)
        sys.exit(1)
    print(f"children agree n={len(children)}", flush=True)
print(f"done sha256={h}", flush=True)

"""A 2 x 2 tensor x data parallel job: communicators made with ncclCommSplit; no pitstop code.

Ranks (tp, dp) = (rank % 2, rank // 2).  Each step: the tensor-parallel pair all-gathers
its shards of an activation and all-reduces a partial product; the data-parallel pair
all-reduces gradients; the world broadcasts a scalar from rank 0.
NCCLPY_GROUPS=init: the pairs are communicators of their own, each made with ncclCommInitRank
from an id its first member shares (as PyTorch's new_group makes them without splitting), so
that a pair can lie wholly on one host.
"""

import os

import ncclpy
import numpy as np
from nccl_common import args, finish, pause, step_line

a = args()
assert a.world == 4, "this workload is 2 x 2"
world = ncclpy.init(a.world, ncclpy.share_id(os.path.join(a.rendezvous, "world.id"), a.rank), a.rank)
tp_rank, dp_rank = a.rank % 2, a.rank // 2
if os.environ.get("NCCLPY_GROUPS") == "init":
    tp = ncclpy.init(2, ncclpy.share_id(os.path.join(a.rendezvous, f"tp{dp_rank}.id"), tp_rank), tp_rank)
    dp = ncclpy.init(2, ncclpy.share_id(os.path.join(a.rendezvous, f"dp{tp_rank}.id"), dp_rank), dp_rank)
else:
    tp = ncclpy.split(world, color=dp_rank, key=tp_rank)    # ranks sharing a dp index
    dp = ncclpy.split(world, color=tp_rank, key=dp_rank)    # ranks sharing a tp index
rng = np.random.default_rng(100 + a.rank)
W = (rng.standard_normal((32, 16)) * 0.1).astype(np.float32)   # this rank's shard
for step in range(1, a.steps + 1):
    x = np.random.default_rng(step * 10 + dp_rank).standard_normal((8, 32)).astype(np.float32)
    part = x @ W                                   # (8, 16): this shard's columns
    full = np.empty((2, 8, 16), dtype=np.float32)
    ncclpy.allgather(tp, part, full)               # both shards' outputs
    act = np.tanh(np.concatenate([full[0], full[1]], axis=1))
    s = np.array([act.sum()], dtype=np.float32)
    ncclpy.allreduce(tp, s)
    grad = (x.T @ (act[:, tp_rank * 16:(tp_rank + 1) * 16] * np.float32(1e-3))).astype(np.float32)
    ncclpy.allreduce(dp, grad)
    W -= np.float32(0.05) * grad
    lr = np.array([float(step)], dtype=np.float64)
    ncclpy.broadcast(world, lr, root=0)
    step_line(step, float(s[0]))
    pause(a)
for c in (tp, dp, world):
    ncclpy.destroy(c)
finish(a, W)

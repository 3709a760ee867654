"""Data-parallel SGD over NCCL (allreduce of gradients); no pitstop code."""

import os

import ncclpy
import numpy as np
from nccl_common import args, finish, pause, step_line

a = args()
comm = ncclpy.init(a.world, ncclpy.share_id(os.path.join(a.rendezvous, "world.id"), a.rank), a.rank)
rng = np.random.default_rng(10 + a.rank)
X = rng.standard_normal((4096, 64)).astype(np.float32)
w_true = np.linspace(-1, 1, 64, dtype=np.float32)
y = X @ w_true
w = np.zeros(64, dtype=np.float32)
for step in range(1, a.steps + 1):
    i = (step * 64) % 4096
    xb, yb = X[i:i + 64], y[i:i + 64]
    grad = (2.0 / 64) * xb.T @ (xb @ w - yb)
    grad = grad.astype(np.float32)
    ncclpy.allreduce(comm, grad, ncclpy.SUM)
    w -= np.float32(0.01) * grad / np.float32(a.world)
    loss = np.array([np.mean((xb @ w - yb) ** 2)], dtype=np.float64)
    ncclpy.allreduce(comm, loss, ncclpy.AVG)
    step_line(step, float(loss[0]))
    pause(a)
ncclpy.destroy(comm)
finish(a, w)

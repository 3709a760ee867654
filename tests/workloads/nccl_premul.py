"""Data-parallel SGD whose gradients are averaged by PreMulSum reduction operators; no pitstop code.

NCCLPY_PREMUL=around (default): as PyTorch's ProcessGroupNCCL does for a PREMUL_SUM reduction, every
all-reduce makes its operator (the scalar 1/world, read at once), uses it and destroys it: none is
alive between collectives.  NCCLPY_PREMUL=kept: two operators made at the start and kept: one whose
scalar is read at each collective from the job's own memory (ncclScalarDevice; the job changes it
every step, a learning-rate schedule), one with an immediate scalar; a third, made first and
destroyed at once, leaves its slot free, so that operators made again on another communicator get
other values than the job holds.
"""

import os

import ncclpy
import numpy as np
from nccl_common import args, finish, pause, step_line

a = args()
mode = os.environ.get("NCCLPY_PREMUL", "around")
comm = ncclpy.init(a.world, ncclpy.share_id(os.path.join(a.rendezvous, "world.id"), a.rank), a.rank)
rng = np.random.default_rng(20 + a.rank)
X = rng.standard_normal((4096, 64)).astype(np.float32)
w_true = np.linspace(-1, 1, 64, dtype=np.float32)
y = X @ w_true
w = np.zeros(64, dtype=np.float32)
inv_world = np.array([1.0 / a.world], dtype=np.float32)
scale = np.zeros(1, dtype=np.float32)  # read by the device-residence operator at each collective
half = np.array([0.5], dtype=np.float64)
if mode == "kept":
    gone = ncclpy.premul_sum(comm, inv_world)
    lr_op = ncclpy.premul_sum(comm, scale, ncclpy.SCALAR_DEVICE)
    half_op = ncclpy.premul_sum(comm, half)
    ncclpy.redop_destroy(comm, gone)
for step in range(1, a.steps + 1):
    i = (step * 64) % 4096
    xb, yb = X[i:i + 64], y[i:i + 64]
    grad = ((2.0 / 64) * xb.T @ (xb @ w - yb)).astype(np.float32)
    loss = np.array([np.mean((xb @ w - yb) ** 2)], dtype=np.float64)
    if mode == "kept":
        scale[0] = np.float32(0.02 / a.world) / np.float32(1.0 + step / 500)  # lr / world, decaying
        ncclpy.allreduce(comm, grad, lr_op)       # sum of lr/world * grad_r
        w -= grad
        ncclpy.allreduce(comm, loss, half_op)     # half the sum of the losses
    else:
        op = ncclpy.premul_sum(comm, inv_world)
        ncclpy.allreduce(comm, grad, op)          # the mean gradient
        ncclpy.redop_destroy(comm, op)
        w -= np.float32(0.01) * grad
        op = ncclpy.premul_sum(comm, np.array([1.0 / a.world], dtype=np.float64))
        ncclpy.allreduce(comm, loss, op)
        ncclpy.redop_destroy(comm, op)
    step_line(step, float(loss[0]))
    pause(a)
if mode == "kept":
    ncclpy.redop_destroy(comm, lr_op)
    ncclpy.redop_destroy(comm, half_op)
ncclpy.destroy(comm)
finish(a, w)

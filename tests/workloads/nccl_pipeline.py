"""A 4-stage pipeline with grouped send/recv (forward and backward each step); no pitstop code."""

import os

import ncclpy
import numpy as np
from nccl_common import args, finish, pause, step_line

a = args()
comm = ncclpy.init(a.world, ncclpy.share_id(os.path.join(a.rendezvous, "world.id"), a.rank), a.rank)
r, n = a.rank, a.world
W = (np.random.default_rng(7 + r).standard_normal((16, 16)) * 0.2).astype(np.float32)
for step in range(1, a.steps + 1):
    # forward: stage 0 makes the input; each stage sends its output to the next
    h = np.random.default_rng(step).standard_normal((4, 16)).astype(np.float32) if r == 0 else \
        np.empty((4, 16), dtype=np.float32)
    ncclpy.group_start()
    if r > 0:
        ncclpy.recv(comm, h, r - 1)
    ncclpy.group_end()
    out = np.tanh(h @ W).astype(np.float32)
    ncclpy.group_start()
    if r < n - 1:
        ncclpy.send(comm, out, r + 1)
    ncclpy.group_end()
    # backward: the last stage starts; gradients flow back
    g = np.empty((4, 16), dtype=np.float32)
    if r == n - 1:
        g = (out * np.float32(0.01)).astype(np.float32)
    else:
        ncclpy.group_start()
        ncclpy.recv(comm, g, r + 1)
        ncclpy.group_end()
    W -= np.float32(0.1) * (h.T @ g).astype(np.float32)
    gin = (g @ W.T).astype(np.float32)
    if r > 0:
        ncclpy.group_start()
        ncclpy.send(comm, gin, r - 1)
        ncclpy.group_end()
    step_line(step, float(np.abs(out).mean()))
    pause(a)
ncclpy.destroy(comm)
finish(a, W)

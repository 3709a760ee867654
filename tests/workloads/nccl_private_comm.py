"""Data-parallel SGD whose second communicator bypasses the shim: it is made and used through a
handle of the program's own on libnccl (`lib`, not the global API), as a library bundling its own
NCCL calls may do.  The shim never sees that communicator's creation, so a cut could neither
destroy nor re-create it; it learns of it only when NCCL asks its own public API about it, and
must then call the job unmovable.  No pitstop code."""

import ctypes
import os

import ncclpy
import numpy as np
from nccl_common import args, finish, pause, step_line

a = args()
world = ncclpy.init(a.world, ncclpy.share_id(os.path.join(a.rendezvous, "world.id"), a.rank), a.rank)
side = ctypes.c_void_p()  # through the library handle: the shim is not in this path
ncclpy.lib.ncclCommInitRank.argtypes = ncclpy.api.ncclCommInitRank.argtypes
ncclpy.check(ncclpy.lib.ncclCommInitRank(ctypes.byref(side), a.world,
                                         ncclpy.share_id(os.path.join(a.rendezvous, "side.id"), a.rank), a.rank),
             "ncclCommInitRank (side)")
ncclpy.lib.ncclAllReduce.argtypes = ncclpy.api.ncclAllReduce.argtypes
w = np.zeros(64, dtype=np.float32)
for step in range(1, a.steps + 1):
    grad = np.full(64, float(a.rank + step) * 1e-3, dtype=np.float32)
    ncclpy.allreduce(world, grad, ncclpy.SUM)
    w -= grad
    count = np.array([1.0], dtype=np.float32)
    ncclpy.check(ncclpy.lib.ncclAllReduce(count.ctypes.data_as(ctypes.c_void_p), count.ctypes.data_as(ctypes.c_void_p),
                                          1, ncclpy.FLOAT32, ncclpy.SUM, side, None), "ncclAllReduce (side)")
    step_line(step, float(count[0]))
    pause(a)
ncclpy.lib.ncclCommDestroy(side)
ncclpy.destroy(world)
finish(a, w)

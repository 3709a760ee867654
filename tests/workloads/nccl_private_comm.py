"""Data-parallel SGD whose second communicator lives in NCCL linked into another library: the
library named by PRIVATE_NCCL (a framework that builds NCCL in, binding its own calls inside
itself), loaded with ctypes and used through its own names.  No libnccl the shim can stand in
front of is involved, so a cut could neither destroy nor re-create that communicator; the shim
sees the library when it is loaded and must call the job unmovable.  No pitstop code."""

import ctypes
import os

import ncclpy
import numpy as np
from nccl_common import args, finish, pause, step_line

a = args()
world = ncclpy.init(a.world, ncclpy.share_id(os.path.join(a.rendezvous, "world.id"), a.rank), a.rank)
lib = ctypes.CDLL(os.environ["PRIVATE_NCCL"], mode=os.RTLD_LOCAL)
lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(ncclpy.UniqueId)]
lib.ncclCommInitRank.argtypes = ncclpy.api.ncclCommInitRank.argtypes
lib.ncclAllReduce.argtypes = ncclpy.api.ncclAllReduce.argtypes
lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
path = os.path.join(a.rendezvous, "side.id")
uid = ncclpy.UniqueId()
if a.rank == 0:
    ncclpy.check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId (side)")
    with open(path + ".tmp", "wb") as f:
        f.write(bytes(uid))
    os.replace(path + ".tmp", path)
else:
    uid = ncclpy.share_id(path, a.rank)  # waits for rank 0's file
side = ctypes.c_void_p()
ncclpy.check(lib.ncclCommInitRank(ctypes.byref(side), a.world, uid, a.rank), "ncclCommInitRank (side)")
w = np.zeros(64, dtype=np.float32)
for step in range(1, a.steps + 1):
    grad = np.full(64, float(a.rank + step) * 1e-3, dtype=np.float32)
    ncclpy.allreduce(world, grad, ncclpy.SUM)
    w -= grad
    count = np.array([1.0], dtype=np.float32)
    ncclpy.check(lib.ncclAllReduce(count.ctypes.data_as(ctypes.c_void_p), count.ctypes.data_as(ctypes.c_void_p),
                                   1, ncclpy.FLOAT32, ncclpy.SUM, side, None), "ncclAllReduce (side)")
    step_line(step, float(count[0]))
    pause(a)
lib.ncclCommDestroy(side)
ncclpy.destroy(world)
finish(a, w)

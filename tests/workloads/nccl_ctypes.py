"""Data parallel with a split communicator, through a libnccl the program loads itself, as vLLM's
PyNccl communicator and CuPy's NCCL bindings do: ctypes.CDLL on the library, RTLD_LOCAL, every
NCCL function taken from that handle (so through dlsym), nothing through the global scope.  No
pitstop code.

NCCL_SO_PATH names the library, as vLLM's VLLM_NCCL_SO_PATH does: a soname found through the
loader's search path, or a full path; libnccl.so.2 if unset.  NCCL_ALSO_SONAME=1 also loads
libnccl.so.2 by soname (first) and trains a second, smaller model on a world of its own there: with
NCCL_SO_PATH a copy at another path, two copies of NCCL in one process.

Ranks (half, pair) = (rank % 2, rank // 2).  Each step: the world all-reduces the gradient and
broadcasts a learning rate from rank 0; the split communicator of the ranks sharing `half`
all-gathers a shard of an activation and all-reduces a scalar.
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np
from nccl_common import args, finish, pause, step_line

FLOAT32, FLOAT64 = 7, 8
SUM = 0
_DT = {np.dtype(np.float32): FLOAT32, np.dtype(np.float64): FLOAT64}


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * 128)]  # bytes, not a C string: ids contain NULs


def _p(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


class Nccl:
    """One loaded libnccl, through its own handle."""

    def __init__(self, name: str) -> None:
        self.lib = L = ctypes.CDLL(name, mode=ctypes.RTLD_LOCAL)
        vp, i = ctypes.c_void_p, ctypes.c_int
        L.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
        L.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), i, UniqueId, i]
        L.ncclCommSplit.argtypes = [vp, i, i, ctypes.POINTER(vp), vp]
        L.ncclAllReduce.argtypes = [vp, vp, ctypes.c_size_t, i, i, vp, vp]
        L.ncclAllGather.argtypes = [vp, vp, ctypes.c_size_t, i, vp, vp]
        L.ncclBroadcast.argtypes = [vp, vp, ctypes.c_size_t, i, i, vp, vp]
        L.ncclCommDestroy.argtypes = [vp]
        L.ncclGetErrorString.restype = ctypes.c_char_p

    def check(self, r: int, what: str) -> None:
        if r != 0:
            raise RuntimeError(f"{what} failed: {r} {self.lib.ncclGetErrorString(r).decode()}")

    def share_id(self, path: str, rank: int) -> UniqueId:
        uid = UniqueId()
        if rank == 0:
            self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
            with open(path + ".tmp", "wb") as f:
                f.write(bytes(uid))
            os.replace(path + ".tmp", path)
            return uid
        while not os.path.exists(path):
            time.sleep(0.01)
        with open(path, "rb") as f:
            ctypes.memmove(ctypes.addressof(uid), f.read(), 128)
        return uid

    def init(self, nranks: int, uid: UniqueId, rank: int) -> ctypes.c_void_p:
        comm = ctypes.c_void_p()
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank), "ncclCommInitRank")
        return comm

    def split(self, comm: ctypes.c_void_p, color: int, key: int) -> ctypes.c_void_p:
        new = ctypes.c_void_p()
        self.check(self.lib.ncclCommSplit(comm, color, key, ctypes.byref(new), None), "ncclCommSplit")
        return new

    def allreduce(self, comm: ctypes.c_void_p, a: np.ndarray) -> None:
        self.check(self.lib.ncclAllReduce(_p(a), _p(a), a.size, _DT[a.dtype], SUM, comm, None), "ncclAllReduce")

    def allgather(self, comm: ctypes.c_void_p, send: np.ndarray, recv: np.ndarray) -> None:
        self.check(self.lib.ncclAllGather(_p(send), _p(recv), send.size, _DT[send.dtype], comm, None),
                   "ncclAllGather")

    def broadcast(self, comm: ctypes.c_void_p, a: np.ndarray, root: int) -> None:
        self.check(self.lib.ncclBroadcast(_p(a), _p(a), a.size, _DT[a.dtype], root, comm, None), "ncclBroadcast")

    def destroy(self, comm: ctypes.c_void_p) -> None:
        self.check(self.lib.ncclCommDestroy(comm), "ncclCommDestroy")


a = args()
# The soname first: a library loaded by path after it is a second copy (loaded by soname after the
# path, the loader would hand back the same one).
second = Nccl("libnccl.so.2") if os.environ.get("NCCL_ALSO_SONAME") == "1" else None
nccl = Nccl(os.environ.get("NCCL_SO_PATH") or "libnccl.so.2")
world = nccl.init(a.world, nccl.share_id(os.path.join(a.rendezvous, "world.id"), a.rank), a.rank)
half, pair = a.rank % 2, a.rank // 2
sub = nccl.split(world, color=half, key=pair)
world2 = (second.init(a.world, second.share_id(os.path.join(a.rendezvous, "world2.id"), a.rank), a.rank)
          if second else None)

rng = np.random.default_rng(7 + a.rank)
W = (rng.standard_normal((16, 8)) * 0.1).astype(np.float32)
V = np.zeros(4, dtype=np.float64)
for step in range(1, a.steps + 1):
    x = np.random.default_rng(step * 31 + a.rank).standard_normal((4, 16)).astype(np.float32)
    part = np.tanh(x @ W)                                   # (4, 8)
    both = np.empty((len(range(half, a.world, 2)), 4, 8), dtype=np.float32)  # one shard per member of sub
    nccl.allgather(sub, part, both)
    s = np.array([both.sum()], dtype=np.float32)
    nccl.allreduce(sub, s)
    grad = (x.T @ (part * np.float32(1e-3) * s[0])).astype(np.float32)
    nccl.allreduce(world, grad)
    lr = np.array([0.05 / (1 + 0.01 * step)], dtype=np.float64)
    nccl.broadcast(world, lr, root=0)
    W -= np.float32(lr[0]) * grad
    if second:
        g2 = np.full(4, (a.rank + 1) * 1e-3 * step, dtype=np.float64)
        second.allreduce(world2, g2)
        V -= g2
    step_line(step, float(s[0]))
    pause(a)
if second:
    second.destroy(world2)
nccl.destroy(sub)
nccl.destroy(world)
finish(a, W, V)

"""A minimal ctypes binding of the NCCL API, as an application would have one.

Symbols are resolved through the process's global scope, the way a program
linked against libnccl resolves them (so a preloaded library can interpose,
exactly as it would for PyTorch).  The unique id travels through a file in a
shared directory: the application's own out-of-band channel.
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

# NCCLPY_SCOPE=local loads libnccl as PyTorch ends up with it: in a local scope (the
# dependency of a library Python dlopened RTLD_LOCAL), reachable only through a preloaded
# shim in the global scope.
_local = os.environ.get("NCCLPY_SCOPE") == "local"
lib = ctypes.CDLL("libnccl.so.2", mode=ctypes.RTLD_LOCAL if _local else ctypes.RTLD_GLOBAL)
api = ctypes.CDLL(None)

FLOAT32, FLOAT64, INT32 = 7, 8, 2
SUM, PROD, MAX, MIN, AVG = 0, 1, 2, 3, 4
_DT = {np.dtype(np.float32): 7, np.dtype(np.float64): 8, np.dtype(np.int32): 2, np.dtype(np.int64): 4,
       np.dtype(np.float16): 6}


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_ubyte * 128)]  # bytes, not a C string: ids contain NULs


# Prototypes matter: ncclUniqueId is passed by value (128 bytes).
api.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
api.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
api.ncclCommSplit.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                              ctypes.c_void_p]
for _f in ("ncclAllReduce", "ncclReduceScatter"):
    getattr(api, _f).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_void_p]
api.ncclAllGather.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p]
api.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_void_p]
for _f in ("ncclSend", "ncclRecv"):
    getattr(api, _f).argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                 ctypes.c_void_p]
api.ncclReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                           ctypes.c_void_p, ctypes.c_void_p]
api.ncclCommDestroy.argtypes = [ctypes.c_void_p]
api.ncclRedOpCreatePreMulSum.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                         ctypes.c_void_p]
api.ncclRedOpDestroy.argtypes = [ctypes.c_int, ctypes.c_void_p]
SCALAR_DEVICE, SCALAR_HOST_IMMEDIATE = 0, 1  # ncclScalarResidence_t
api.ncclCommGetAsyncError.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]


def check(r: int, what: str) -> None:
    if r != 0:
        api.ncclGetErrorString.restype = ctypes.c_char_p
        api.ncclGetLastError.restype = ctypes.c_char_p
        raise RuntimeError(f"{what} failed: {r} {api.ncclGetErrorString(r).decode()}: "
                           f"{(api.ncclGetLastError(None) or b'').decode()}")


def share_id(path: str, rank: int) -> UniqueId:
    uid = UniqueId()
    if rank == 0:
        check(api.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        with open(path + ".tmp", "wb") as f:
            f.write(bytes(uid))
        os.replace(path + ".tmp", path)
        return uid
    while not os.path.exists(path):
        time.sleep(0.01)
    with open(path, "rb") as f:
        ctypes.memmove(ctypes.addressof(uid), f.read(), 128)
    return uid


class Config(ctypes.Structure):
    """ncclConfig_t as NCCL 2.17 laid it out (NCCL_CONFIG_INITIALIZER, then blocking)."""
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p), ("splitShare", ctypes.c_int)]


INT_MIN = -2147483648  # NCCL_CONFIG_UNDEF_INT
# NCCLPY_NONBLOCKING=1: communicators are made nonblocking (config.blocking = 0), as
# PyTorch makes them when asked; init and split then answer ncclInProgress and are polled.
NONBLOCKING = os.environ.get("NCCLPY_NONBLOCKING") == "1"


def _config() -> Config | None:
    if not NONBLOCKING:
        return None
    return Config(ctypes.sizeof(Config), 0xCAFEBEEF, 21700, 0, INT_MIN, INT_MIN, INT_MIN, None, INT_MIN)


def _wait_ready(comm: ctypes.c_void_p, r: int, what: str) -> None:
    if r == 7:  # ncclInProgress
        st = ctypes.c_int(7)
        end = time.monotonic() + 60
        while st.value == 7 and time.monotonic() < end:
            check(api.ncclCommGetAsyncError(comm, ctypes.byref(st)), "ncclCommGetAsyncError")
            time.sleep(0.001)
        r = st.value
    check(r, what)


def init(nranks: int, uid: UniqueId, rank: int) -> ctypes.c_void_p:
    comm = ctypes.c_void_p()
    cfg = _config()
    if cfg is None:
        check(api.ncclCommInitRank(ctypes.byref(comm), nranks, uid, rank), "ncclCommInitRank")
        return comm
    api.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int,
                                           ctypes.POINTER(Config)]
    _wait_ready(comm, api.ncclCommInitRankConfig(ctypes.byref(comm), nranks, uid, rank, ctypes.byref(cfg)),
                "ncclCommInitRankConfig")
    return comm


def split(comm: ctypes.c_void_p, color: int, key: int) -> ctypes.c_void_p:
    new = ctypes.c_void_p()
    cfg = _config()
    r = api.ncclCommSplit(comm, color, key, ctypes.byref(new), ctypes.byref(cfg) if cfg else None)
    _wait_ready(new, r, "ncclCommSplit")
    return new


def _p(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def allreduce(comm, a: np.ndarray, op: int = SUM) -> None:
    check(api.ncclAllReduce(_p(a), _p(a), a.size, _DT[a.dtype], op, comm, None), "ncclAllReduce")


def allgather(comm, send: np.ndarray, recv: np.ndarray) -> None:
    check(api.ncclAllGather(_p(send), _p(recv), send.size, _DT[send.dtype], comm, None),
          "ncclAllGather")


def broadcast(comm, a: np.ndarray, root: int) -> None:
    check(api.ncclBroadcast(_p(a), _p(a), a.size, _DT[a.dtype], root, comm, None), "ncclBroadcast")


def send(comm, a: np.ndarray, peer: int) -> None:
    check(api.ncclSend(_p(a), a.size, _DT[a.dtype], peer, comm, None), "ncclSend")


def recv(comm, a: np.ndarray, peer: int) -> None:
    check(api.ncclRecv(_p(a), a.size, _DT[a.dtype], peer, comm, None), "ncclRecv")


def group_start() -> None:
    check(api.ncclGroupStart(), "ncclGroupStart")


def group_end() -> None:
    check(api.ncclGroupEnd(), "ncclGroupEnd")


def premul_sum(comm, scalar: np.ndarray, residence: int = SCALAR_HOST_IMMEDIATE) -> int:
    """A PreMulSum operator: each rank's input times scalar[0], then summed.  SCALAR_DEVICE: the
    scalar is read at each collective from where `scalar` lies (it must outlive the operator)."""
    op = ctypes.c_int(-1)
    check(api.ncclRedOpCreatePreMulSum(ctypes.byref(op), _p(scalar), _DT[scalar.dtype], residence, comm),
          "ncclRedOpCreatePreMulSum")
    return op.value


def redop_destroy(comm, op: int) -> None:
    check(api.ncclRedOpDestroy(op, comm), "ncclRedOpDestroy")


def destroy(comm) -> None:
    check(api.ncclCommDestroy(comm), "ncclCommDestroy")

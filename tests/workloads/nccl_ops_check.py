"""Every datatype x reduction of the host NCCL against numpy, on WORLD_SIZE ranks.

Prints one line "ok <n>" when all checks pass on this rank; raises otherwise.
"""

import os
import sys

import ncclpy
import numpy as np

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
comm = ncclpy.init(world, ncclpy.share_id(os.path.join(sys.argv[1], "ops.id"), rank), rank)
api = ncclpy.api
TYPES = {np.float32: 7, np.float64: 8, np.int32: 2, np.int64: 4, np.float16: 6}
OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
n = 0


def data(r, dt):
    g = np.random.default_rng(1000 + r)
    if np.issubdtype(dt, np.integer):
        return g.integers(-5, 6, 33).astype(dt)
    return (g.standard_normal(33) * 2).astype(dt)


def ref(dt, op):
    blocks = [data(r, dt) for r in range(world)]
    acc = blocks[0].copy()
    for b in blocks[1:]:  # rank order, element type arithmetic (float16 through float32, rounded each step)
        x = acc.astype(np.float32) if dt == np.float16 else acc
        y = b.astype(np.float32) if dt == np.float16 else b
        r = {"sum": x + y, "avg": x + y, "prod": x * y, "max": np.maximum(x, y), "min": np.minimum(x, y)}[op]
        acc = r.astype(dt)
    if op == "avg":
        acc = (acc.astype(np.float32) / np.float32(world)).astype(dt) if dt == np.float16 else \
            (acc // world if np.issubdtype(dt, np.integer) else (acc / dt(world)).astype(dt))
    return acc


for dt, code in TYPES.items():
    for name, op in OPS.items():
        a = data(rank, dt)
        out = np.empty_like(a)
        ncclpy.check(api.ncclAllReduce(a.ctypes.data, out.ctypes.data, a.size, code, op, comm, None), "allreduce")
        want = ref(dt, name)
        if np.issubdtype(dt, np.integer) and name == "avg":
            want = np.trunc(sum(data(r, dt).astype(np.int64) for r in range(world)) / world).astype(dt)
            # C integer division truncates toward zero
            s = sum(data(r, dt).astype(np.int64) for r in range(world))
            want = (np.sign(s) * (np.abs(s) // world)).astype(dt)
        assert out.tobytes() == want.tobytes(), (dt, name, out[:5], want[:5])
        n += 1
# PreMulSum operators: each rank's input times the scalar (in its type; float16 through float32,
# rounded), then summed in rank order.  An immediate scalar is read when the operator is made, a
# device one (here host memory) at each collective.
def premul_ref(dt, k):
    def scaled(b):
        return (b.astype(np.float32) * np.float32(k)).astype(dt) if dt == np.float16 else (b * dt(k)).astype(dt)
    blocks = [scaled(data(r, dt)) for r in range(world)]
    acc = blocks[0].copy()
    for b in blocks[1:]:
        acc = ((acc.astype(np.float32) + b.astype(np.float32)) if dt == np.float16 else acc + b).astype(dt)
    return acc


for dt, code in TYPES.items():
    for residence in (ncclpy.SCALAR_HOST_IMMEDIATE, ncclpy.SCALAR_DEVICE):
        k = np.array([3 if np.issubdtype(dt, np.integer) else 0.375], dtype=dt)
        op = ncclpy.premul_sum(comm, k, residence)
        assert op >= 5, op
        made = k[0]
        k[0] = k[0] * 2  # an immediate scalar was read already; a device one is read below
        a = data(rank, dt)
        out = np.empty_like(a)
        ncclpy.check(api.ncclAllReduce(a.ctypes.data, out.ctypes.data, a.size, code, op, comm, None), "premul")
        want = premul_ref(dt, made if residence == ncclpy.SCALAR_HOST_IMMEDIATE else k[0])
        assert out.tobytes() == want.tobytes(), (dt, residence, out[:5], want[:5])
        ncclpy.redop_destroy(comm, op)
        n += 1
# an operator is of its datatype and its communicator, and ends when destroyed
op = ncclpy.premul_sum(comm, np.array([2.0], dtype=np.float32))
x = np.ones(3, dtype=np.float64)
assert api.ncclAllReduce(x.ctypes.data, x.ctypes.data, 3, 8, op, comm, None) == 4  # ncclInvalidArgument
ncclpy.redop_destroy(comm, op)
assert api.ncclRedOpDestroy(op, comm) == 4
n += 1
# reduce-scatter, allgather, broadcast, reduce
a = np.arange(world * 4, dtype=np.float32) + rank
out = np.empty(4, dtype=np.float32)
ncclpy.check(api.ncclReduceScatter(a.ctypes.data, out.ctypes.data, 4, 7, 0, comm, None), "reducescatter")
assert (out == sum(np.arange(world * 4, dtype=np.float32) + r for r in range(world))[rank * 4:(rank + 1) * 4]).all()
g = np.empty(world * 3, dtype=np.int64)
ncclpy.allgather(comm, np.full(3, rank, dtype=np.int64), g)
assert (g == np.repeat(np.arange(world), 3)).all()
b = np.full(5, rank, dtype=np.float64)
ncclpy.broadcast(comm, b, root=world - 1)
assert (b == world - 1).all()
red = np.empty(2, dtype=np.int32)
ncclpy.check(api.ncclReduce(np.array([rank, 1], dtype=np.int32).ctypes.data, red.ctypes.data, 2, 2, 0, 0, comm,
                            None), "reduce")
if rank == 0:
    assert list(red) == [sum(range(world)), world]
ncclpy.destroy(comm)
print(f"ok {n + 4}", flush=True)

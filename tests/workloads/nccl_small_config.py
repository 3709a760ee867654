"""ncclCommInitRankConfig with an older, smaller ncclConfig_t that ends right before a guard page.

Any read past config->size faults.  World of 1 over the host NCCL.  Prints "ok" on success."""

import ctypes
import mmap

import ncclpy

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
page = mmap.PAGESIZE
base = libc.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
assert libc.mprotect(base + page, page, 0) == 0
SMALL = 16  # size_t size; unsigned magic; unsigned version: an "older" struct
cfg = base + page - SMALL
ctypes.memmove(cfg, ctypes.byref(ctypes.c_size_t(SMALL)), 8)
ctypes.memmove(cfg + 8, ctypes.byref(ctypes.c_uint(0xCAFEBEEF)), 4)
ctypes.memmove(cfg + 12, ctypes.byref(ctypes.c_uint(22900)), 4)
uid = ncclpy.UniqueId()
ncclpy.check(ncclpy.api.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
comm = ctypes.c_void_p()
ncclpy.api.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ncclpy.UniqueId,
                                              ctypes.c_int, ctypes.c_void_p]
ncclpy.check(ncclpy.api.ncclCommInitRankConfig(ctypes.byref(comm), 1, uid, 0, cfg), "ncclCommInitRankConfig")
ncclpy.destroy(comm)
print("ok", flush=True)

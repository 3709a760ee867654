"""The CUDA driver's process-checkpoint API (cuda-bindings), behind a small protocol.

cuda-checkpoint's five calls are all pitstop needs: GetState, Lock (with a
timeout), Checkpoint, Restore (with GPU UUID pairs) and Unlock.  They are
reached through cuda-bindings so that no C is compiled for them; a fake that
implements `CudaDriver` drives the state machine in unit tests.

Struct layouts: cuda-bindings fills CUcheckpointRestoreArgs with its own
(13.x) layout.  Every layout the driver has used (before 13.3: pointer, count,
reserved[], reserved1; 13.3: pointer, count, reserved[]; later: pointer,
count, padding, customStorageInfo_out, reserved[]) keeps the UUID-pair
pointer at offset 0 and the count at offset 8 in a 64-byte struct whose
other bytes must be zero.  pitstop only ever sets those two fields, so the
struct reads the same to every driver from 12.8 on; `check_layout` refuses a
bindings build whose struct breaks that assumption instead of passing the
driver bytes it would misread.
"""

from __future__ import annotations

import ctypes
import uuid as uuidlib
from typing import Protocol

MIN_DRIVER = 12080  # cuCheckpointProcess* first shipped with CUDA 12.8 (r570)
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class DriverError(Exception):
    """A CUDA driver call failed; `name` is the CUresult, e.g. CUDA_ERROR_TIMEOUT."""

    def __init__(self, call: str, name: str, pid: int | None = None) -> None:
        super().__init__(f"{call}({pid if pid is not None else ''}) failed: {name}")
        self.call, self.name, self.pid = call, name, pid


class NoDriver(Exception):
    """No usable CUDA driver on this host (no GPU, no libcuda, or too old)."""


class CudaDriver(Protocol):
    def state(self, pid: int) -> str: ...
    def lock(self, pid: int, timeout_ms: int) -> None: ...
    def checkpoint(self, pid: int) -> None: ...
    def restore(self, pid: int, pairs: list[tuple[str, str]]) -> None: ...
    def unlock(self, pid: int) -> None: ...
    def version(self) -> int: ...


def uuid_bytes(gpu_uuid: str) -> bytes:
    """NVML's "GPU-xxxxxxxx-..." (or a bare UUID) as the 16 bytes of a CUuuid."""
    return uuidlib.UUID(gpu_uuid.removeprefix("GPU-").removeprefix("MIG-")).bytes


class BindingsDriver:
    """The real driver through cuda.bindings.driver; cuInit happens once, here."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import driver as cu
        except ImportError as e:
            raise NoDriver(f"cuda-bindings is not installed ({e})") from None
        self.cu = cu
        try:
            (err,) = cu.cuInit(0)
        except Exception as e:  # noqa: BLE001 - pathfinder raises its own type when libcuda is absent
            why = ("libcuda.so.1 not found" if "NotFound" in type(e).__name__
                   else f"{type(e).__name__}: {str(e)[:100]}")
            raise NoDriver(f"no CUDA driver: {why}") from None
        if err != cu.CUresult.CUDA_SUCCESS:
            raise NoDriver(f"cuInit failed: {err.name}")
        err, v = cu.cuDriverGetVersion()
        self._version = int(v)
        if self._version < MIN_DRIVER:
            raise NoDriver(f"driver supports CUDA {v // 1000}.{v % 1000 // 10}; process checkpoint needs 12.8+")
        check_layout(cu)

    def version(self) -> int:
        return self._version

    def _ok(self, call: str, pid: int, res: tuple) -> tuple:
        err = res[0]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise DriverError(call, err.name, pid)
        return res[1:]

    def state(self, pid: int) -> str:
        (st,) = self._ok("cuCheckpointProcessGetState", pid, self.cu.cuCheckpointProcessGetState(pid))
        return STATES.get(int(st), str(st))

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = self.cu.CUcheckpointLockArgs()
        args.timeoutMs = max(1, int(timeout_ms))  # 0 would mean "wait forever"
        self._ok("cuCheckpointProcessLock", pid, self.cu.cuCheckpointProcessLock(pid, args))

    def checkpoint(self, pid: int) -> None:
        self._ok("cuCheckpointProcessCheckpoint", pid, self.cu.cuCheckpointProcessCheckpoint(pid, None))

    def restore(self, pid: int, pairs: list[tuple[str, str]]) -> None:
        args = None
        remap = [(a, b) for a, b in pairs if a != b]
        if remap:
            args = self.cu.CUcheckpointRestoreArgs()
            ps = []
            for old, new in pairs:  # the driver wants every checkpointed GPU once remapping
                p = self.cu.CUcheckpointGpuPair()
                _set_uuid(p.oldUuid, old)
                _set_uuid(p.newUuid, new)
                ps.append(p)
            args.gpuPairs = ps
            args.gpuPairsCount = len(ps)
        self._ok("cuCheckpointProcessRestore", pid, self.cu.cuCheckpointProcessRestore(pid, args))

    def unlock(self, pid: int) -> None:
        self._ok("cuCheckpointProcessUnlock", pid, self.cu.cuCheckpointProcessUnlock(pid, None))


def _set_uuid(field: object, gpu_uuid: str) -> None:
    """CUuuid.bytes is read-only in cuda-bindings; write the 16 bytes in place."""
    ctypes.memmove(int(field.getPtr()), uuid_bytes(gpu_uuid), 16)  # type: ignore[attr-defined]


def check_layout(cu: object) -> None:
    """Refuse bindings whose restore-args struct moved the two fields pitstop sets."""
    args = cu.CUcheckpointRestoreArgs()  # type: ignore[attr-defined]
    base = int(args.getPtr())
    raw = (ctypes.c_ubyte * 64).from_address(base)
    if any(raw):
        raise NoDriver("cuda-bindings' CUcheckpointRestoreArgs is not zero-initialised; refusing to pass it")
    args.gpuPairsCount = 0x5A5A
    count_at_8 = int.from_bytes(bytes(raw[8:12]), "little") == 0x5A5A
    args.gpuPairsCount = 0
    if not count_at_8:
        raise NoDriver("cuda-bindings' CUcheckpointRestoreArgs layout differs from the driver ABI "
                       "(gpuPairsCount not at offset 8); install a cuda-bindings that matches the driver")


def load() -> CudaDriver:
    """The host's driver, or NoDriver saying plainly why there is none."""
    return BindingsDriver()

"""GPU state around a CRIU dump: lock and checkpoint before, restore and unlock after.

The order is the one CRIU's own cuda plugin follows, and the failure rules
are what keep a job alive:

  lock (with a deadline)  - a lock that times out is undone: the worker never
                            stopped computing, nothing was captured;
  checkpoint              - device memory goes to host memory and the GPU is
                            released, so CRIU sees an ordinary process;
  ... CRIU dump, transfer, CRIU restore ...
  restore (UUID remap)    - on the destination's GPUs, pair by pair;
  unlock                  - CUDA calls proceed.

Any failure after the lock is undone on the source (restore with no remap,
then unlock) before the error is reported, so the source keeps running.  The
driver needs the target's restore thread to run: restore is only called on a
process that is not stopped (after SIGCONT, or after CRIU restored it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from pitstop.errors import CaptureFailed, RestoreFailed
from pitstop.gpu.driver import CudaDriver, DriverError, NoDriver, load
from pitstop.proc import proctree

log = structlog.get_logger("pitstop.gpu.checkpoint")


def cuda_pids(pids: list[int]) -> list[int]:
    """The processes that hold a CUDA context: an open /dev/nvidia* file or mapping.

    Cheap and driver-free, so that hosts without GPUs never load libcuda.
    """
    out = []
    for pid in pids:
        if _touches_nvidia(pid):
            out.append(pid)
    return out


def _touches_nvidia(pid: int) -> bool:
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                    return True
            except OSError:
                continue
        with open(f"/proc/{pid}/maps") as f:
            return any("/dev/nvidia" in line for line in f)
    except OSError:
        return False


T = TypeVar("T")
SUSPEND_ROUNDS = 4


def at_once(call: Callable[[T], None], items: list[T]) -> tuple[list[T], list[tuple[T, DriverError]]]:
    """Run a driver call for every process at the same time; (those it succeeded for, in order;
    those it failed for, with the driver's error).

    Why threads: the driver's checkpoint and restore copy at a per-process rate. On an H200 VM
    8 GiB went out at 0.75-0.82 GB/s from one process and at 2.7 GB/s from 4 processes (3.6 GB/s
    from 8) checkpointed together (tests/gpu/gpu_check.py --d-parallel, docs/benchmarks.md), and
    cuda-bindings releases the GIL during the call.  An error other than the driver's is raised
    once every call has returned, so no call is left running behind the caller."""
    if not items:
        return [], []
    with ThreadPoolExecutor(max_workers=min(len(items), 16), thread_name_prefix="gpu") as pool:
        futures = [pool.submit(call, it) for it in items]
        wait(futures)
    done: list[T] = []
    failed: list[tuple[T, DriverError]] = []
    other: BaseException | None = None
    for it, f in zip(items, futures):
        e = f.exception()
        if e is None:
            done.append(it)
        elif isinstance(e, DriverError):
            failed.append((it, e))
        else:
            other = other or e
    if other is not None:
        raise other
    return done, failed


@dataclass
class GpuProcess:
    pid: int     # host pid, on the host that holds it now
    ns_pid: int  # pid inside the worker's pid namespace: stable across CRIU restore


@dataclass
class Suspended:
    """What suspend() did, enough to undo it here or to finish it elsewhere."""

    procs: list[GpuProcess]
    lock_s: float
    checkpoint_s: float
    source: dict[str, Any] = field(default_factory=dict)  # GPU model, UUIDs, driver, CUDA version
    rounds: int = 1  # looks at the tree it took to find every CUDA process (suspend's `rescan`)
    device_bytes: int | None = None  # device memory its processes held as they were checkpointed (NVML)

    def record(self) -> dict[str, Any]:
        """The image manifest's "gpu" section."""
        return {**self.source, "processes": [p.ns_pid for p in self.procs], "host_pids": [p.pid for p in self.procs],
                "lock_s": self.lock_s, "checkpoint_s": self.checkpoint_s, "rounds": self.rounds,
                "device_bytes": self.device_bytes}


def remap_pairs(src: dict[str, Any], dst_inventory: dict[str, Any]) -> list[tuple[str, str]]:
    """Source GPU i goes to destination GPU i; refuse a spare that cannot take them."""
    src_uuids = list(src.get("uuids") or [])
    dst_uuids = [g["uuid"] for g in dst_inventory.get("gpus", [])]
    if not src_uuids:
        return []
    if not dst_uuids:
        raise RestoreFailed("the image holds GPU state but this host has no GPU "
                            f"({dst_inventory.get('gpu_note') or 'not present'})", code="gpu_mismatch",
                            action="restore on a host with the same GPU model and count")
    if src.get("model") and dst_inventory.get("gpu_model") != src["model"]:
        raise RestoreFailed(f"the image was taken on {src['model']} GPUs; this host has "
                            f"{dst_inventory.get('gpu_model')}", code="gpu_mismatch",
                            action="restore on a host with the same GPU model")
    if len(dst_uuids) < len(src_uuids):
        raise RestoreFailed(f"the image used {len(src_uuids)} GPUs; this host has {len(dst_uuids)}",
                            code="gpu_mismatch", action="restore on a host with at least as many GPUs")
    return list(zip(src_uuids, dst_uuids[:len(src_uuids)]))


class GpuCheckpointer:
    def __init__(self, lock_timeout_s: float = 10.0, driver: Callable[[], CudaDriver] = load,
                 inventory: Callable[[], dict[str, Any]] | None = None,
                 used_memory: Callable[[list[int]], dict[int, int]] | None = None) -> None:
        self.lock_timeout_s = lock_timeout_s
        self._factory = driver
        self._driver: CudaDriver | None = None
        if inventory is None:
            from pitstop.gpu.inventory import inventory as inv
            inventory = inv
        if used_memory is None:
            from pitstop.gpu.inventory import used_device_memory
            used_memory = used_device_memory
        self._inventory = inventory
        self._used_memory: Callable[[list[int]], dict[int, int]] = used_memory

    def driver(self) -> CudaDriver:
        if self._driver is None:
            self._driver = self._factory()
        return self._driver

    # -- source --------------------------------------------------------------------------------
    def suspend(self, pids: list[int], rescan: Callable[[], list[int]] | None = None) -> Suspended | None:
        """Lock then checkpoint every CUDA process of a tree; None when none holds CUDA state.

        The tree runs while this happens (the driver needs its processes running), so a process
        can begin to use CUDA after the first look: a launcher's child still importing torch.
        CRIU then meets its device mapping and the dump fails (seen on an H200 with a tree of three
        CUDA processes, once in two runs).  `rescan` lists the tree again after each round; new
        CUDA processes are suspended in another round, up to SUSPEND_ROUNDS, until a look finds
        none.  A process that begins to use CUDA in the few milliseconds between the last look
        and CRIU's freeze still fails the dump, and the worker runs on (its GPUs given back)."""
        targets = cuda_pids(pids)
        if not targets:
            return None
        try:
            drv = self.driver()
        except NoDriver as e:
            raise CaptureFailed(f"the worker uses a GPU but this agent cannot reach the CUDA driver: {e}",
                                code="gpu_driver_unavailable",
                                action="run the agent on the GPU host with the NVIDIA driver (>= 570) loaded; "
                                       "the worker keeps running") from None
        done: list[GpuProcess] = []
        lock_s = checkpoint_s = 0.0
        used: dict[int, int] = {}
        for rounds in range(1, SUSPEND_ROUNDS + 1):
            used |= self._used_memory(targets)  # what the checkpoint will copy out (the released cache gone)
            procs = [GpuProcess(p, (proctree.ns_pids(p) or [p])[-1]) for p in targets]
            t0 = time.monotonic()
            self._lock(drv, procs, done)
            t1 = time.monotonic()
            self._checkpoint(drv, procs, done)
            t2 = time.monotonic()
            done += procs
            lock_s, checkpoint_s = lock_s + t1 - t0, checkpoint_s + t2 - t1
            if rescan is None:
                break
            seen = {p.pid for p in done}
            targets = [p for p in cuda_pids(rescan()) if p not in seen]
            if not targets:
                break
        else:
            self._undo(drv, done, done)
            raise CaptureFailed(f"processes of the worker kept beginning to use CUDA while it was being suspended "
                                f"(pids {targets} after {SUSPEND_ROUNDS} rounds)", code="gpu_tree_changing",
                                action="the worker keeps running on its GPUs; evacuate again once its "
                                       "processes have started")
        inv = self._inventory()
        src = {"model": inv.get("gpu_model"), "uuids": [g["uuid"] for g in inv.get("gpus", [])],
               "driver": inv.get("driver"), "cuda": drv.version()}
        log.info("gpu state checkpointed", pids=[p.pid for p in done], lock_s=round(lock_s, 4),
                 checkpoint_s=round(checkpoint_s, 4), rounds=rounds)
        return Suspended(done, lock_s, checkpoint_s, src, rounds,
                         device_bytes=sum(used.values()) if used else None)

    def _lock(self, drv: CudaDriver, procs: list[GpuProcess], before: list[GpuProcess]) -> None:
        """All at once: processes of one tree may wait on each other's kernels (ranks of a torchrun
        under one launcher), so locking one while another still computes could time out where
        locking all together does not.  A failure undoes this round and those `before` it."""
        locked, failed = at_once(lambda p: drv.lock(p.pid, int(self.lock_timeout_s * 1000)), procs)
        if not failed:
            return
        self._undo(drv, before + locked, before)
        p, e = failed[0]
        if e.name == "CUDA_ERROR_TIMEOUT":
            raise CaptureFailed(
                f"pid {p.pid} did not reach a point where its CUDA work could be locked within "
                f"{self.lock_timeout_s:.0f} s (a kernel or a blocking CUDA call was still running)",
                code="gpu_lock_timeout",
                action="nothing was captured and the worker keeps running; retry, or raise "
                       "PITSTOP_AGENT_GPU_LOCK_TIMEOUT_S for jobs with long kernels")
        raise CaptureFailed(f"cannot lock the CUDA state of pid {p.pid}: {e}", code="gpu_lock_failed",
                            action="the worker keeps running; see the agent's log")

    def _checkpoint(self, drv: CudaDriver, procs: list[GpuProcess], before: list[GpuProcess]) -> None:
        done, failed = at_once(lambda p: drv.checkpoint(p.pid), procs)
        if not failed:
            return
        self._undo(drv, before + procs, before + done)
        p, e = failed[0]
        raise CaptureFailed(f"cannot checkpoint the GPU memory of pid {p.pid}: {e}",
                            code="gpu_checkpoint_failed",
                            action="the worker was restored on its GPUs and keeps running; check "
                                   "host memory (device memory is copied to host RAM)")

    def _undo(self, drv: CudaDriver, locked: list[GpuProcess], checkpointed: list[GpuProcess]) -> list[str]:
        """Put every touched process back to running; collect what could not be undone."""
        def back(p: GpuProcess) -> None:
            if p in checkpointed:
                drv.restore(p.pid, [])
            drv.unlock(p.pid)

        _, failed = at_once(back, locked)
        for p, e in failed:
            log.error("cannot undo GPU suspend", pid=p.pid, error=str(e))
        return [str(e) for _, e in failed]

    def resume_in_place(self, record: dict[str, Any]) -> None:
        """Undo suspend() on the source, for a rollback.  The processes must not be stopped."""
        pids = record.get("host_pids") or []
        if not pids:
            return
        drv = self.driver()
        procs = [GpuProcess(p, n) for p, n in zip(pids, record.get("processes", []))]
        problems = self._undo(drv, procs, procs)
        if problems:
            raise RestoreFailed("the worker's GPU state could not be put back: " + "; ".join(problems),
                                code="gpu_restore_failed",
                                action="the worker's CUDA calls stay blocked; restart the job from its "
                                       "last checkpoint and report the driver error")

    # -- destination ---------------------------------------------------------------------------
    def resume_restored(self, root_pid: int, record: dict[str, Any]) -> dict[str, float]:
        """Restore GPU state into a tree CRIU just restored (remapped onto this host's GPUs), then unlock."""
        ns = list(record.get("processes") or [])
        if not ns:
            return {}
        pairs = remap_pairs(record, self._inventory())
        try:
            drv = self.driver()
        except NoDriver as e:
            raise RestoreFailed(f"the image holds GPU state but the CUDA driver is unusable here: {e}",
                                code="gpu_driver_unavailable", action="restore on a GPU host") from None
        by_ns = {(proctree.ns_pids(p) or [p])[-1]: p for p in proctree.tree(root_pid)}
        missing = [n for n in ns if n not in by_ns]
        if missing:
            raise RestoreFailed(f"restored tree lacks the CUDA processes {missing} (pids in the worker's namespace)",
                                code="gpu_restore_failed", action="the images are kept; roll back")
        t0 = time.monotonic()
        _, failed = at_once(lambda n: drv.restore(by_ns[n], pairs), ns)
        if failed:
            n, err = failed[0]
            raise RestoreFailed(f"cannot restore GPU memory of pid {by_ns[n]} onto "
                                f"{', '.join(b for _, b in pairs) or 'its GPUs'}: {err}",
                                code="gpu_restore_failed",
                                action="the restored copy is discarded and the source rolled back")
        t1 = time.monotonic()
        _, failed = at_once(lambda n: drv.unlock(by_ns[n]), ns)
        if failed:
            n, err = failed[0]
            raise RestoreFailed(f"cannot unlock CUDA in pid {by_ns[n]}: {err}", code="gpu_restore_failed",
                                action="the restored copy is discarded and the source rolled back")
        return {"gpu_restore": t1 - t0, "gpu_unlock": time.monotonic() - t1}

"""The GPU capture state machine against a fake CUDA driver (CI has no GPU).

The fake enforces the driver's own transitions (running -> locked ->
checkpointed -> locked -> running) and fails on request, so every test
checks the one invariant that matters: whatever fails, every process ends
"running" on its GPUs unless a move completed.  The real driver is proven by
tests/gpu/run.sh on a GPU host.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from pitstop.errors import CaptureFailed, RestoreFailed
from pitstop.gpu import checkpoint as ck
from pitstop.gpu.driver import DriverError, NoDriver, check_layout, load, uuid_bytes

pytestmark = pytest.mark.timeout(60)

H200 = {"gpu_model": "NVIDIA H200", "driver": "580.65",
        "gpus": [{"uuid": f"GPU-0000000{i}-aaaa-bbbb-cccc-000000000000"} for i in range(2)]}
SPARE = {"gpu_model": "NVIDIA H200", "driver": "580.65",
         "gpus": [{"uuid": f"GPU-1111111{i}-aaaa-bbbb-cccc-000000000000"} for i in range(2)]}


class FakeDriver:
    def __init__(self, fail: dict[tuple[str, int], str] | None = None) -> None:
        self.st: dict[int, str] = {}
        self.fail = fail or {}
        self.calls: list[tuple] = []

    def _go(self, call: str, pid: int, frm: str, to: str) -> None:
        self.calls.append((call, pid))
        if (call, pid) in self.fail:
            raise DriverError(call, self.fail[(call, pid)], pid)
        cur = self.st.setdefault(pid, "running")
        if cur != frm:
            raise DriverError(call, f"CUDA_ERROR_ILLEGAL_STATE (is {cur})", pid)
        self.st[pid] = to

    def state(self, pid: int) -> str:
        return self.st.get(pid, "running")

    def lock(self, pid: int, timeout_ms: int) -> None:
        assert timeout_ms > 0, "a lock without a deadline can hang forever"
        self._go("lock", pid, "running", "locked")

    def checkpoint(self, pid: int) -> None:
        self._go("checkpoint", pid, "locked", "checkpointed")

    def restore(self, pid: int, pairs: list[tuple[str, str]]) -> None:
        self.calls.append(("pairs", pid, tuple(pairs)))
        self._go("restore", pid, "checkpointed", "locked")

    def unlock(self, pid: int) -> None:
        self._go("unlock", pid, "locked", "running")

    def version(self) -> int:
        return 13000


@pytest.fixture
def procs(monkeypatch):
    """Three real processes, treated as CUDA holders; their ns pid is their pid."""
    ps = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)]
    pids = [p.pid for p in ps]
    monkeypatch.setattr(ck, "cuda_pids", lambda xs: [x for x in xs if x in pids])
    yield pids
    for p in ps:
        p.kill()
        p.wait()


def gpu(drv: FakeDriver, inv=H200) -> ck.GpuCheckpointer:
    return ck.GpuCheckpointer(lock_timeout_s=2, driver=lambda: drv, inventory=lambda: inv)


def test_a_tree_without_cuda_never_loads_the_driver():
    def boom():
        raise AssertionError("driver loaded for a CPU-only tree")
    assert ck.GpuCheckpointer(driver=boom, inventory=lambda: {}).suspend([os.getpid()]) is None
    assert ck.cuda_pids([os.getpid()]) == []


def test_suspend_then_resume_in_place(procs):
    drv = FakeDriver()
    g = gpu(drv)
    s = g.suspend(procs)
    assert all(drv.state(p) == "checkpointed" for p in procs)
    rec = s.record()
    assert rec["model"] == "NVIDIA H200" and rec["uuids"] == [x["uuid"] for x in H200["gpus"]]
    assert rec["driver"] == "580.65" and rec["cuda"] == 13000 and rec["processes"] == procs
    g.resume_in_place(rec)
    assert all(drv.state(p) == "running" for p in procs)
    assert ("pairs", procs[0], ()) in drv.calls  # no remap on the source's own GPUs


def test_lock_timeout_undoes_earlier_locks_and_says_what_to_do(procs):
    drv = FakeDriver(fail={("lock", procs[1]): "CUDA_ERROR_TIMEOUT"})
    with pytest.raises(CaptureFailed) as e:
        gpu(drv).suspend(procs)
    assert e.value.code == "gpu_lock_timeout" and "GPU_LOCK_TIMEOUT_S" in e.value.action
    assert "keeps running" in e.value.action
    assert all(drv.state(p) == "running" for p in procs)
    assert ("checkpoint", procs[0]) not in drv.calls


def test_failure_after_lock_restores_and_unlocks_the_source(procs):
    drv = FakeDriver(fail={("checkpoint", procs[2]): "CUDA_ERROR_OUT_OF_MEMORY"})
    with pytest.raises(CaptureFailed) as e:
        gpu(drv).suspend(procs)
    assert e.value.code == "gpu_checkpoint_failed" and "CUDA_ERROR_OUT_OF_MEMORY" in e.value.message
    assert all(drv.state(p) == "running" for p in procs), drv.st


class MeetingDriver(FakeDriver):
    """Every lock, checkpoint and restore waits until all three processes are in the same call:
    called one after another, the first would wait for the others in vain."""

    def __init__(self, n: int, **kw) -> None:
        super().__init__(**kw)
        self.meet = {c: threading.Barrier(n, timeout=5) for c in ("lock", "checkpoint", "restore")}

    def _go(self, call: str, pid: int, frm: str, to: str) -> None:
        if call in self.meet:
            self.meet[call].wait()
        super()._go(call, pid, frm, to)


def test_the_processes_of_a_tree_are_locked_checkpointed_and_restored_at_once(procs):
    """The driver copies at a per-process rate (4 processes: 3.6 x one's on an H200)."""
    drv = MeetingDriver(len(procs))
    rec = gpu(drv).suspend(procs).record()
    assert all(drv.state(p) == "checkpointed" for p in procs)
    gpu(drv).resume_in_place(rec)  # restores (and unlocks) them at once too
    assert all(drv.state(p) == "running" for p in procs), drv.st


def test_a_restored_trees_processes_are_restored_at_once():
    from pitstop.proc import proctree

    root = subprocess.Popen([sys.executable, "-c", "import signal, subprocess, sys, time\n"
                             "ks = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']) "
                             "for _ in range(2)]\n"
                             "def end(*_):\n    [k.kill() for k in ks]; [k.wait() for k in ks]; sys.exit(0)\n"
                             "signal.signal(signal.SIGTERM, end)\nprint('ready', flush=True)\n"
                             "while True: time.sleep(0.1)"],  # a handler runs between bytecodes only
                            stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout.readline().strip() == "ready"
        tree = proctree.tree(root.pid)
        assert len(tree) == 3
        drv = MeetingDriver(3)
        for p in tree:
            drv.st[p] = "checkpointed"  # as CRIU restores them
        rec = {"model": "NVIDIA H200", "uuids": [g["uuid"] for g in H200["gpus"]], "processes": tree}
        timings = gpu(drv, SPARE).resume_restored(root.pid, rec)
        assert all(drv.state(p) == "running" for p in tree) and set(timings) == {"gpu_restore", "gpu_unlock"}
    finally:
        root.terminate()  # it ends its children and waits for them
        root.wait(30)


def test_one_failure_among_checkpoints_at_once_puts_every_process_back(procs):
    drv = MeetingDriver(len(procs), fail={("checkpoint", procs[1]): "CUDA_ERROR_OUT_OF_MEMORY"})
    drv.meet["restore"] = threading.Barrier(len(procs) - 1, timeout=5)  # the two that were checkpointed
    with pytest.raises(CaptureFailed) as e:
        gpu(drv).suspend(procs)
    assert e.value.code == "gpu_checkpoint_failed" and str(procs[1]) in e.value.message
    assert all(drv.state(p) == "running" for p in procs), drv.st


def test_a_process_that_begins_to_use_cuda_during_the_suspend_is_suspended_too(procs, monkeypatch):
    """The tree runs while it is suspended: a child still importing torch at the first look holds
    CUDA by the time the first round is over (an H200 dump failed on its device mapping so).  Each
    later look suspends what is new, until one finds nothing new."""
    looks = iter([procs[:2], procs, procs])
    monkeypatch.setattr(ck, "cuda_pids", lambda xs: [x for x in xs if x in procs])
    drv = FakeDriver()
    s = gpu(drv).suspend(procs[:1], rescan=lambda: next(looks))
    assert all(drv.state(p) == "checkpointed" for p in procs), drv.st
    assert s.record()["processes"] == procs and s.rounds == 3
    assert [c for c in drv.calls if c[0] == "lock"] == [("lock", p) for p in procs]  # each once
    gpu(drv).resume_in_place(s.record())
    assert all(drv.state(p) == "running" for p in procs)


def test_a_tree_that_keeps_beginning_cuda_is_refused_and_put_back(procs, monkeypatch):
    extra = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(ck.SUSPEND_ROUNDS)]
    try:
        everyone = procs[:1] + [p.pid for p in extra]
        monkeypatch.setattr(ck, "cuda_pids", lambda xs: [x for x in xs if x in everyone])
        n = iter(range(2, len(everyone) + 1))
        drv = FakeDriver()
        with pytest.raises(CaptureFailed) as e:
            gpu(drv).suspend(procs[:1], rescan=lambda: everyone[:next(n)])  # one more at every look
        assert e.value.code == "gpu_tree_changing" and "keeps running" in e.value.action
        assert all(drv.state(p) == "running" for p in everyone), drv.st
    finally:
        for p in extra:
            p.kill()
            p.wait()


def test_a_lock_failing_in_a_later_round_puts_the_earlier_rounds_back(procs, monkeypatch):
    monkeypatch.setattr(ck, "cuda_pids", lambda xs: [x for x in xs if x in procs])
    drv = FakeDriver(fail={("lock", procs[2]): "CUDA_ERROR_TIMEOUT"})
    with pytest.raises(CaptureFailed) as e:
        gpu(drv).suspend(procs[:2], rescan=lambda: procs)
    assert e.value.code == "gpu_lock_timeout"
    assert all(drv.state(p) == "running" for p in procs), drv.st


def test_an_error_not_the_drivers_is_raised_once_every_call_has_returned():
    ended: list[int] = []

    def call(i: int) -> None:
        if i == 0:
            raise KeyError("not the driver's")
        time.sleep(0.2)
        ended.append(i)

    with pytest.raises(KeyError):
        ck.at_once(call, [0, 1, 2])
    assert sorted(ended) == [1, 2]


def test_no_driver_refuses_before_touching_anything(procs):
    def none():
        raise NoDriver("no CUDA driver (DynamicLibNotFoundError)")
    with pytest.raises(CaptureFailed) as e:
        ck.GpuCheckpointer(driver=none, inventory=lambda: H200).suspend(procs)
    assert e.value.code == "gpu_driver_unavailable" and "DynamicLibNotFoundError" in e.value.message


def test_restore_remaps_every_gpu_in_order_then_unlocks(procs):
    src = FakeDriver()
    rec = gpu(src).suspend(procs[:1]).record()
    dst = FakeDriver()
    dst.st[procs[0]] = "checkpointed"  # as CRIU restores it
    timings = gpu(dst, SPARE).resume_restored(procs[0], rec)
    assert dst.state(procs[0]) == "running" and set(timings) == {"gpu_restore", "gpu_unlock"}
    pairs = [c for c in dst.calls if c[0] == "pairs"][0][2]
    assert pairs == tuple(zip(rec["uuids"], [g["uuid"] for g in SPARE["gpus"]]))
    assert dst.calls.index(("restore", procs[0])) < dst.calls.index(("unlock", procs[0]))


def test_restore_failure_is_reported_for_rollback(procs):
    rec = gpu(FakeDriver()).suspend(procs[:1]).record()
    dst = FakeDriver(fail={("restore", procs[0]): "CUDA_ERROR_INVALID_DEVICE"})
    dst.st[procs[0]] = "checkpointed"
    with pytest.raises(RestoreFailed) as e:
        gpu(dst, SPARE).resume_restored(procs[0], rec)
    assert e.value.code == "gpu_restore_failed" and "rolled back" in e.value.action


@pytest.mark.parametrize("inv,why", [
    ({"gpu_model": "NVIDIA A100", "gpus": [{"uuid": "GPU-1"}, {"uuid": "GPU-2"}]}, "A100"),
    ({"gpu_model": "NVIDIA H200", "gpus": [{"uuid": "GPU-1"}]}, "this host has 1"),
    ({"gpu_model": None, "gpus": [], "gpu_note": "not present (NVMLError)"}, "no GPU"),
])
def test_mismatched_destination_gpus_are_refused(inv, why):
    rec = {"model": "NVIDIA H200", "uuids": [g["uuid"] for g in H200["gpus"]], "processes": [1]}
    with pytest.raises(RestoreFailed) as e:
        ck.remap_pairs(rec, inv)
    assert e.value.code == "gpu_mismatch" and why in e.value.message


def test_restored_tree_missing_a_cuda_process_is_refused(procs):
    rec = {"model": "NVIDIA H200", "uuids": [g["uuid"] for g in H200["gpus"]], "processes": [987654]}
    with pytest.raises(RestoreFailed) as e:
        gpu(FakeDriver(), SPARE).resume_restored(procs[0], rec)
    assert "987654" in e.value.message


def test_real_driver_here_says_plainly_why_not():
    """On this (GPU-less) machine the real cuda-bindings path must fail with a reason, not crash."""
    try:
        drv = load()
    except NoDriver as e:
        assert str(e).startswith("no CUDA driver") or "cuda-bindings" in str(e)
        return
    pytest.skip(f"a CUDA driver is present (CUDA {drv.version()}); tests/gpu covers it")


def test_bindings_restore_args_layout_matches_the_driver_abi():
    from cuda.bindings import driver as cu

    check_layout(cu)  # pair pointer at 0, count at 8, zeroed 64 bytes: what every driver reads
    assert uuid_bytes("GPU-12345678-1234-1234-1234-123456789abc").hex() == "12345678123412341234123456789abc"


def test_the_device_bytes_the_checkpoint_copies_are_recorded(procs):
    """NVML's per-process figure as the processes were suspended: what moved (the ledger's
    `checkpointed`, beside what the release at the cut freed)."""
    drv = MeetingDriver(len(procs))
    seen = []

    def used(pids):
        seen.append(list(pids))
        return {p: 3 * 2**30 for p in pids}

    g = ck.GpuCheckpointer(lock_timeout_s=2, driver=lambda: drv, inventory=lambda: H200, used_memory=used)
    s = g.suspend(procs)
    assert s is not None and s.record()["device_bytes"] == 3 * 2**30 * len(procs) and seen == [procs]
    g.resume_in_place(s.record())

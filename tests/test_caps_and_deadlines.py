"""Capabilities a restore must grant (proc/caps.py, coordinator/planner.py), the restore
deadline (criu/criu_ops.py) and what an agent cleans up at start: logic with real processes,
no mocks of the kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pitstop.coordinator import planner
from pitstop.criu import criu_ops, runtime
from pitstop.errors import FailedPrecondition, RestoreFailed
from pitstop.proc import caps, proctree
from pitstop.wire.store_rows import StoredHost, StoredWorker

pytestmark = pytest.mark.timeout(60)
UNIT_SET = (1 << 40) | (1 << 21) | (1 << 19) | (1 << 8)  # checkpoint_restore, sys_admin, sys_ptrace, setpcap


def test_names_and_missing():
    assert caps.names(1 << 21 | 1 << 40) == ["cap_sys_admin", "cap_checkpoint_restore"]
    assert caps.missing(1 << 16 | 1 << 21, 1 << 21) == ["cap_sys_module"]
    assert caps.missing(0, 0) == []  # a worker without capabilities moves anywhere
    assert caps.names(1 << 63) == ["cap_63"]  # a kernel newer than this table


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_a_launcher_limits_what_its_workers_can_hold():
    code = ("import subprocess, sys; from pitstop.proc import caps; "
            f"dropped = caps.limit_bounding_set({UNIT_SET}); "
            # the child reports its own sets, after its exec (a look from outside could come
            # before it, while the child still holds the launcher's permitted set)
            "st = subprocess.run(['cat', '/proc/self/status'], capture_output=True, text=True).stdout; "
            "f = dict(l.split(':', 1) for l in st.splitlines() if l.startswith('Cap')); "
            "need = int(f['CapPrm'], 16) | int(f['CapInh'], 16) | int(f['CapAmb'], 16); "
            "print(len(dropped), hex(caps.bounding_set()), hex(need))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    n, bnd, need = out.stdout.split()
    assert int(n) > 0 and int(bnd, 16) == UNIT_SET & caps.bounding_set()
    assert caps.missing(int(need, 16), UNIT_SET) == []  # a child of root: holds no more than the set


class _Store:
    def __init__(self, dst_bnd: str | None, need: str | None) -> None:
        self.dst_bnd, self.need = dst_bnd, need

    def host(self, n: str) -> StoredHost:
        return StoredHost(name=n, url=f"http://{n}:7070", last_seen=time.time(), age_s=0.0, role="spare",
                          cap_bnd=self.dst_bnd if n == "dst" else None)

    def hosts(self) -> list[StoredHost]:
        return [self.host("src"), self.host("dst")]

    def workers(self, host: str | None = None, job: str | None = None) -> list[StoredWorker]:
        return [StoredWorker(id="j.0", job="j", rank=0, host="src", state="running", updated=0.0, caps=self.need)]


def test_capabilities_held_only_inside_a_user_namespace_are_not_needs():
    """Before: a worker that made a user namespace of its own (and so held every capability there)
    made its node impossible to evacuate ("cannot grant cap_sys_resource")."""
    p = subprocess.Popen(["unshare", "--user", "--map-root-user", "sleep", "30"])
    try:
        for _ in range(100):
            if os.readlink(f"/proc/{p.pid}/ns/user") != os.readlink("/proc/self/ns/user"):
                break
            time.sleep(0.02)
        held = int(caps._status(p.pid)["CapPrm"], 16)
        assert held >> 24 & 1, "inside its namespace it holds cap_sys_resource"
        assert caps.needs(p.pid) == 0
    finally:
        p.kill()
        p.wait(10)
    q = subprocess.Popen(["sleep", "30"])  # the host's root: its capabilities are needs
    try:
        assert caps.needs(q.pid) == int(caps._status(q.pid)["CapPrm"], 16) != 0
    finally:
        q.kill()
        q.wait(10)


def test_the_planner_refuses_a_destination_that_cannot_grant_a_workers_capabilities():
    with pytest.raises(FailedPrecondition) as e:
        planner.plan(_Store(f"{UNIT_SET:x}", f"{UNIT_SET | 1 << 16:x}"), "src", "dst", {}, 5.0)
    assert "cannot grant cap_sys_module, which worker j.0 holds" in e.value.message
    assert "CapabilityBoundingSet" in e.value.action and e.value.code == "no_compatible_spare"
    assert planner.plan(_Store(f"{UNIT_SET:x}", f"{UNIT_SET:x}"), "src", "dst", {}, 5.0).dest.name == "dst"
    assert planner.plan(_Store(f"{UNIT_SET:x}", None), "src", "dst", {}, 5.0)  # nothing held, nothing needed
    assert planner.plan(_Store(None, f"{UNIT_SET | 1 << 16:x}"), "src", "dst", {}, 5.0)  # an agent not saying
    with pytest.raises(FailedPrecondition) as e:  # the same, when pitstop picks the spare: the remedy is said too
        planner.plan(_Store(f"{UNIT_SET:x}", f"{UNIT_SET | 1 << 16:x}"), "src", None, {}, 5.0)
    assert "dst: its agent cannot grant cap_sys_module" in e.value.message
    assert "CapabilityBoundingSet" in e.value.action


def _hanging_criu(tmp_path: Path) -> runtime.CriuRuntime:
    """A `criu` that answers nothing and forks a child: CRIU stuck in a restore, as a restorer
    BUG leaves it.  pycriu and the RPC are the real ones."""
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\nsleep 300 &\nwait\n")
    fake.chmod(0o755)
    real = runtime.locate()
    return runtime.CriuRuntime(str(fake), (4, 2), real.pycriu_path, None, "env")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CRIU)")
@pytest.mark.parametrize("how", ["deadline", "abort"])
def test_a_restore_that_hangs_is_killed_with_what_it_forked(tmp_path, how):
    images = tmp_path / "images"
    images.mkdir()
    rt = _hanging_criu(tmp_path)
    abort = threading.Event()
    if how == "abort":
        threading.Timer(0.5, abort.set).start()
    t0 = time.monotonic()
    before = set(proctree.children(os.getpid()))
    with pytest.raises(RestoreFailed) as e:
        criu_ops.restore(images, {}, rt=rt, timeout_s=1.0 if how == "deadline" else 60.0, abort=abort)
    took = time.monotonic() - t0
    assert took < 10, took
    assert ("did not finish restoring within 1 s" if how == "deadline" else "abandoned") in e.value.message
    assert "images are kept" in e.value.action
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # the fake criu and its sleep are gone (reaped by pycriu or us)
        left = [p for p in set(proctree.children(os.getpid())) - before if proctree.state(p) not in (None, "Z")]
        if not left:
            break
        time.sleep(0.05)
    assert not left
    out = subprocess.run(["pgrep", "-f", str(tmp_path / "criu")], capture_output=True, text=True)
    assert out.stdout.strip() == ""


def test_an_agent_removes_images_of_moves_that_died_with_it(tmp_path):
    """Slots live in memory: at start every in-* directory is a dead move's, unless something
    still works in it (a lazy-pages daemon filling a worker restored before the restart)."""
    from pitstop.agent.leftovers import Leftovers
    from pitstop.agent.settings import AgentSettings
    from pitstop.agent.state import AgentState

    s = AgentSettings(name="t", state_dir=tmp_path / "state", image_dir=tmp_path / "images")
    s.state_dir.mkdir()
    for name in ("in-dead", "in-filling", "cap-keep"):
        (s.images / name).mkdir(parents=True)
        (s.images / name / "pages-1.img").write_bytes(b"x" * 4096)
    holder = subprocess.Popen(["sleep", "30"], cwd=s.images / "in-filling")
    try:
        gone = Leftovers(s, AgentState(s.state_dir)).remove_stale_slots()
        # while something works in it, the slot stays (checked before the holder ends: a
        # watcher removes it once it is unused, which raced the old assertion after the kill)
        assert gone == ["in-dead"]
        assert sorted(p.name for p in s.images.iterdir()) == ["cap-keep", "in-filling"]
    finally:
        holder.kill()
        holder.wait()
    end = time.monotonic() + 15
    while (s.images / "in-filling").exists() and time.monotonic() < end:
        time.sleep(0.1)
    assert sorted(p.name for p in s.images.iterdir()) == ["cap-keep"]  # and goes once unused


def test_a_dump_that_meets_a_device_mapping_says_what_happened():
    """CRIU's lines from an H200 run (2026-12-04): a child of the worker began to use CUDA after
    the tree's CUDA processes were suspended, and its device mapping failed the dump."""
    lines = ["(00.803831) Error (criu/proc_parse.c:118): handle_device_vma plugin failed: No such file or directory",
             "(00.803833) Error (criu/proc_parse.c:663): Can't handle non-regular mapping on 1294's map 200600000",
             "(00.803844) Error (criu/cr-dump.c:1440): Collect mappings (pid: 1294) failed with -1"]
    action = criu_ops._dump_action(lines, Path("/x/dump.log"))
    assert "began to use the GPU during the pause" in action and "evacuate again" in action
    assert action.endswith("/x/dump.log")
    assert criu_ops._dump_action(lines[2:], Path("/x/dump.log")) == "the worker was resumed; see /x/dump.log"

"""CRIU's worker is started without forking the agent's Python (criu/swrk.py).

The agent is multi-threaded. A fork copies every lock that another thread holds at that moment.
pycriu's own start forks and then runs Python in the child, and on 2026-12-03 one such child
blocked before its exec: a restore that waited forever, with no pid for its deadline to kill.
The invariant tested here is that no Python runs in the child at all. A hook registered with
os.register_at_fork runs in every child of a Python-level fork; it must not run for this spawn,
and it does run for pycriu's (the control). The tests also check what the worker gets: the fds
meant for it, no other inheritable fd of the agent, and a pid known at once and reaped at the end."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pitstop.criu import criu_ops, runtime, swrk
from pitstop.proc import proctree

from .helpers import end_dumped

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

_MARK: list[Path] = []  # while set, every child of a Python-level fork of this process writes here


def _in_child() -> None:
    if _MARK:
        _MARK[0].write_text(f"forked child {os.getpid()} ran Python\n")


os.register_at_fork(after_in_child=_in_child)


@pytest.fixture
def mark(tmp_path: Path):  # noqa: ANN201
    _MARK[:] = [tmp_path / "python-ran-in-a-child"]
    try:
        yield _MARK[0]
    finally:
        _MARK.clear()


def _fd_targets(pid: int) -> set[str]:
    d = Path(f"/proc/{pid}/fd")
    return {os.readlink(d / n) for n in os.listdir(d)}


def test_the_worker_starts_with_no_python_in_the_child_and_pycriu_would_run_some(mark: Path) -> None:
    rt = runtime.locate()
    spawned = swrk.SpawnedSwrk(runtime.CriuCommand(rt.binary))
    spawned.connect(False)
    pid = spawned.swrk
    try:
        assert pid and proctree.exists(pid), "the worker's pid is known as soon as it starts"
    finally:
        spawned.disconnect()
    assert not mark.exists(), mark.read_text()
    assert not proctree.exists(pid), "disconnect reaps the worker"

    # The control: pycriu's own start runs Python in its forked child (the hook writes the mark).
    rt.import_pycriu()
    theirs = sys.modules["pycriu.criu"]._criu_comm_bin(rt.binary)
    theirs.connect(False)
    theirs.disconnect()
    assert mark.exists(), "pycriu's fork ran no Python in its child: the control does not hold"


def test_only_the_fds_meant_for_it_reach_the_worker() -> None:
    rt = runtime.locate()
    meant_r, meant_w = os.pipe()
    other_r, other_w = os.pipe()
    os.set_inheritable(other_r, True)  # another restore's fd, made inheritable for its own CRIU
    spawned = swrk.SpawnedSwrk(runtime.CriuCommand(rt.binary), pass_fds=(meant_r,))
    try:
        spawned.connect(False)
        seen = _fd_targets(spawned.swrk)
        assert os.readlink(f"/proc/self/fd/{meant_r}") in seen
        assert os.readlink(f"/proc/self/fd/{other_r}") not in seen
    finally:
        spawned.disconnect()
        for fd in (meant_r, meant_w, other_r, other_w):
            os.close(fd)


def test_a_self_dump_is_refused_with_a_reason() -> None:
    with pytest.raises(RuntimeError, match="not supported"):
        swrk.SpawnedSwrk(runtime.CriuCommand(runtime.locate().binary)).connect(True)


def test_dumps_started_from_several_threads_at_once_all_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The case that hung had two CRIU runs starting at once in one agent: here three real dumps
    start from three threads together, each ends, and each of their workers is reaped."""
    workers: list[int] = []
    connect = swrk.SpawnedSwrk.connect

    def recording(self: swrk.SpawnedSwrk, daemon: bool):  # noqa: ANN202
        sk = connect(self, daemon)
        workers.append(self.swrk)
        return sk

    monkeypatch.setattr(swrk.SpawnedSwrk, "connect", recording)
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
             for _ in range(3)]
    results: dict[int, criu_ops.DumpResult] = {}
    errors: list[BaseException] = []
    go = threading.Barrier(3)

    def one(i: int) -> None:
        try:
            go.wait(10)
            results[i] = criu_ops.dump(procs[i].pid, tmp_path / f"img{i}", criu_ops.DumpOptions(timeout_s=30))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        ts = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(45)
        assert not any(t.is_alive() for t in ts), "a dump did not end"
        assert not errors, errors
        assert all((tmp_path / f"img{i}" / "inventory.img").exists() for i in range(3))
    finally:
        for i, p in enumerate(procs):
            end_dumped(p, results[i].run_id if i in results else "")
    assert len(workers) == 3 and not [w for w in workers if Path(f"/proc/{w}").exists()], "a worker was not reaped"


def test_a_worker_killed_mid_request_is_reaped_by_close() -> None:
    """pycriu skips its disconnect when a request fails (the restore's deadline killed CRIU):
    criu_ops closes the worker itself, so none is left a zombie of the agent."""
    import signal

    spawned = swrk.SpawnedSwrk(runtime.CriuCommand(runtime.locate().binary))
    spawned.connect(False)
    pid = spawned.swrk
    os.kill(pid, signal.SIGKILL)
    assert spawned.sk.recv(16) == b"", "our end reads the end of the worker"
    spawned.close()
    spawned.close()  # twice is harmless
    assert not Path(f"/proc/{pid}").exists()


def test_the_commands_environment_reaches_crius_worker_and_a_preload_goes_first(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A preload for one CRIU run is in its environment, not in a script written just before it
    runs: the kernel refused such a script (ETXTBSY) while a process another thread had forked
    still held its write descriptor (CI, a move's restore).  A stand-in for CRIU that records
    what it was given."""
    seen = tmp_path / "env"
    fake = tmp_path / "criu"
    fake.write_text(f'#!/bin/sh\necho "$LD_PRELOAD|$PITSTOP_CRIUFILL_REPORT|$1" > {seen}\n')
    fake.chmod(0o755)
    monkeypatch.setenv("LD_PRELOAD", "/already/there.so")
    rt = runtime.CriuRuntime(str(fake), (4, 2, 1), Path("/nonexistent"), None, "host")
    cmd = runtime.preloaded(rt, Path("/lib/x.so"), env={"PITSTOP_CRIUFILL_REPORT": "/r"})
    w = swrk.SpawnedSwrk(cmd)
    w.connect(False)
    w.close()
    assert seen.read_text().strip() == "/lib/x.so:/already/there.so|/r|swrk"
    assert "PITSTOP_CRIUFILL_REPORT" not in os.environ  # the agent's own environment is untouched

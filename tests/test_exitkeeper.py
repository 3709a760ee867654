"""agent/exitkeeper.py: a worker's exit status, read by a process that is not its parent.

Real processes: the "worker" is a grandchild whose parent exits at once, so it is reparented
and reaped by someone else, exactly as a restored worker is once the agent that restored it
has gone.  Invariant: what the keeper gives back is the status the worker exited with.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pitstop.agent import exitkeeper
from pitstop.proc import proctree

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not exitkeeper.supported(), reason="this kernel has no PIDFD_INFO_EXIT (Linux 6.15+)")]


def _orphan(code: str) -> int:
    """A process that runs `code` and whose parent has already exited: not our child."""
    out = subprocess.run([sys.executable, "-c",
                          "import os, subprocess, sys\n"
                          f"p = subprocess.Popen([sys.executable, '-c', {code!r}], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
                          "print(p.pid)"], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.parametrize("code, status", [("import time, sys; time.sleep(1); sys.exit(3)", 3),
                                          ("import time; time.sleep(1)", 0),
                                          ("import os, time; time.sleep(1); os.kill(os.getpid(), 9)", -9)])
@pytest.mark.slow
def test_the_status_of_a_process_someone_else_reaped(code, status):
    pid = _orphan(code)
    k = exitkeeper.start("w", pid, proctree.start_time(pid) or 0, owner="test")
    assert k is not None
    try:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # not ours to wait for
        assert exitkeeper.exit_status(k, wait_s=15) == status
    finally:
        exitkeeper.stop(k)
    assert not proctree.exists(k.pid)


@pytest.mark.slow
def test_the_status_survives_the_agent_that_started_the_keeper():
    """A keeper started by one process (an agent that then dies) serves another: the worker ends
    while nobody but the keeper holds its pidfd."""
    pid = _orphan("import time, sys; time.sleep(1.5); sys.exit(7)")
    started = proctree.start_time(pid) or 0
    agent = subprocess.run([sys.executable, "-c",
                            "import json, sys\n"
                            "from pitstop.agent import exitkeeper\n"
                            f"k = exitkeeper.start('w', {pid}, {started}, owner='test')\n"
                            "print(json.dumps(k.to_dict()))"], capture_output=True, text=True, check=True)
    k = exitkeeper.Keeper.from_dict(__import__("json").loads(agent.stdout))
    try:
        while proctree.exists(pid):  # it ends while no agent runs
            time.sleep(0.1)
        time.sleep(0.5)
        assert exitkeeper.exit_status(k, wait_s=15) == 7
    finally:
        exitkeeper.stop(k)
    deadline = time.monotonic() + 10
    while proctree.start_time(k.pid) == k.start_time and time.monotonic() < deadline:
        time.sleep(0.1)  # reaped by init or a subreaper above us, not by us
    assert proctree.start_time(k.pid) != k.start_time


def test_a_worker_that_still_runs_has_no_status_yet_and_a_gone_keeper_gives_none():
    pid = _orphan("import time; time.sleep(30)")
    k = exitkeeper.start("w", pid, proctree.start_time(pid) or 0, owner="test")
    assert k is not None
    try:
        assert exitkeeper.exit_status(k, wait_s=0.3) is None
        with open(f"/proc/{k.pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == b"pitstop-exit-keeper w test"
        exitkeeper.stop(k)
        assert exitkeeper.exit_status(k, wait_s=0.3) is None
    finally:
        os.kill(pid, signal.SIGKILL)


def test_a_reused_pid_gets_no_keeper():
    pid = _orphan("import time; time.sleep(30)")
    try:
        assert exitkeeper.start("w", pid, (proctree.start_time(pid) or 0) + 1) is None
    finally:
        os.kill(pid, signal.SIGKILL)

"""A killed run's cluster is removed by the next one, and a live run's is left alone.

Real parts: a LocalCluster with its hosts in network namespaces and a real agent (which mounts
its image tmpfs), in a child process that is then SIGKILLed, as a CI timeout or a closed terminal
would.  The next LocalCluster must kill the agent and remove the namespaces, the bridge, the
mount and the directories; while the child still lives, it must touch none of them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pitstop.dev import devleases
from pitstop.dev.devcluster import LocalCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# a run holding a cluster, an agent in a namespace and its image mount, until it is killed
CHILD = r"""
import time
from pitstop.dev.devcluster import LocalCluster
from pitstop.dev.netns import NetHosts
with LocalCluster() as c:
    c.net = NetHosts()
    a = c.start_agent("host-a")
    print(c.root, c.shm, c.net.tag, a.proc.pid, flush=True)
    time.sleep(600)
"""


def _netns() -> list[str]:
    return os.listdir("/run/netns") if os.path.isdir("/run/netns") else []


def _links() -> str:
    return subprocess.run(["ip", "-br", "link"], capture_output=True, text=True).stdout


def _mounted_under(p: Path) -> bool:
    return any(line.split()[1].startswith(str(p)) for line in Path("/proc/mounts").read_text().splitlines())


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and mounts need root")
def test_next_cluster_removes_what_a_killed_run_left_and_spares_a_live_one(tmp_path, monkeypatch):
    leases = tmp_path / "leases"
    monkeypatch.setenv("PITSTOP_DEV_LEASES", str(leases))  # only this test's leases are swept
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ), start_new_session=True)
    try:
        root, shm, tag, agent_pid = child.stdout.readline().split()  # type: ignore[union-attr]
        root, shm, agent_pid = Path(root), Path(shm), int(agent_pid)
        assert sorted(p.name for p in leases.iterdir())[0].startswith("cluster-")
        assert len(list(leases.iterdir())) == 2  # the cluster's and its hosts' network

        with LocalCluster():  # its owner lives: nothing of it may go
            assert root.exists() and shm.exists() and not _gone(agent_pid)
            assert [n for n in _netns() if n.startswith(f"pst-{tag}-")] == [f"pst-{tag}-host-a"]
            assert _mounted_under(shm)

        child.kill()  # SIGKILL: no finally, no atexit, nothing cleaned
        child.wait(10)
        assert not _gone(agent_pid) and _mounted_under(shm) and f"pst{tag}br" in _links()

        t0 = time.monotonic()
        with LocalCluster() as c:
            swept = time.monotonic() - t0
            assert _gone(agent_pid), "the killed run's agent still runs"
            assert not [n for n in _netns() if n.startswith(f"pst-{tag}-")]
            assert f"pst{tag}br" not in _links()
            assert not _mounted_under(shm) and not shm.exists() and not root.exists()
            assert [json.loads(p.read_text())["pid"] for p in leases.iterdir()] == [os.getpid()]
            assert c.lease in {p.stem for p in leases.iterdir()}
        assert swept < 15
        assert not list(leases.iterdir())  # a clean close drops its own lease
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
        devleases.sweep()


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces and mounts need root")
def test_sigterm_ends_a_run_through_its_cleanup(tmp_path, monkeypatch):
    """SIGTERM (a CI timeout, `kill`) unwinds the run like Ctrl-C: nothing is left for a sweep."""
    leases = tmp_path / "leases"
    monkeypatch.setenv("PITSTOP_DEV_LEASES", str(leases))
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        root, shm, tag, agent_pid = child.stdout.readline().split()  # type: ignore[union-attr]
        child.terminate()
        child.wait(30)
        assert _gone(int(agent_pid)) and not Path(root).exists() and not Path(shm).exists()
        assert not [n for n in _netns() if n.startswith(f"pst-{tag}-")] and f"pst{tag}br" not in _links()
        assert not list(leases.iterdir())
        assert "KeyboardInterrupt" in child.stderr.read()  # type: ignore[union-attr]
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(10)
        devleases.sweep()

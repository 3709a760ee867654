"""native/procself.c: a worker in its own pid namespace, under the host's /proc, finds its own
/proc entries by the ids it knows (CUDA's cuInit fails with error 304 when it cannot: seen on
an H200).  Real processes, a real pid namespace, and a real move with CRIU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pitstop.migration.move import move_worker

from .helpers import WORKLOADS, wait_for_step

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "native" / "build" / "libpitstop_procself.so"
WORKER = WORKLOADS / "procself_worker.py"
pytestmark = pytest.mark.timeout(120)


def _run(preload: bool, pidns: bool) -> subprocess.CompletedProcess:
    env = dict(os.environ, LD_PRELOAD=str(LIB) if preload else "")
    cmd = [sys.executable, str(WORKER), "3"]
    if pidns:
        cmd = ["unshare", "--pid", "--fork", *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def test_in_a_pid_namespace_own_entries_are_missing_without_it_and_found_with_it():
    bare = _run(preload=False, pidns=True)
    assert bare.returncode == 3 and "BAD step 1" in bare.stdout  # the failure CUDA hits
    fixed = _run(preload=True, pidns=True)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert fixed.stdout.count(" ok ") == 3 and "done" in fixed.stdout


def test_outside_a_pid_namespace_nothing_changes():
    for preload in (False, True):
        p = _run(preload=preload, pidns=False)
        assert p.returncode == 0, p.stdout + p.stderr


def test_other_processes_entries_are_left_alone():
    """Only our own ids are rewritten: /proc/<a pid that is not ours> still names that process."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        prog = f"print(open('/proc/{other.pid}/comm').read().strip())"
        p = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", prog], capture_output=True,
                           text=True, timeout=30, env=dict(os.environ, LD_PRELOAD=str(LIB)))
        assert p.returncode == 0 and p.stdout.strip() == "sleep", p.stderr
    finally:
        other.kill()
        other.wait()


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_pitstop_run_preloads_it_and_it_holds_after_a_move(cluster, tmp_path):
    """Under `pitstop run` the worker finds its own entries; moved by CRIU to another host's
    agent (new outer pids), it still does, every step."""
    with cluster.starting():
        a = cluster.start_agent("a")
        b = cluster.start_agent("b", spare=True)
    ranks = cluster.start_job("p", [sys.executable, str(WORKER), "200"], 1, {0: "a"})
    cluster.wait_registered("a", "p.0")
    wait_for_step(ranks[0].log, 5)
    before = re.findall(r"outer=(\d+)", ranks[0].log.read_text())[-1]
    rep = move_worker(a.client(), b.client(), "p.0", dest_name="b", peers=[])
    assert rep.restored_pid
    assert ranks[0].proc.wait(120) == 0, ranks[0].log.read_text()[-1500:]
    log = ranks[0].log.read_text()
    assert "BAD" not in log and "done" in log
    outers = set(re.findall(r"outer=(\d+)", log))
    assert len(outers) == 2 and before in outers  # it ran under two outer pids, correct under both

"""The audit of the snapshot, recovery and local-network surface, replayed against the real
services (real agents and coordinator, CRIU, namespaces; the attacker a real uid 65534).  Each test
fails on the code the audit found it in (docs/reliability.md, "The security audit")."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pitstop.dev.devcluster import pitstop_cmd

from .helpers import WORKLOADS, until, wait_for_step
from .test_coordinator_e2e import _wait_jobs
from .test_worker_network_e2e import _cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _as_nobody(script: str) -> None:
    subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", script],
                   check=True, timeout=30)


@pytest.fixture
def open_dir():
    """A job directory any local user may write to (the audit's premise), reachable by uid 65534
    (under $TMPDIR; pytest's own directories are root's alone)."""
    d = Path(tempfile.mkdtemp(prefix="pitstop-audit-"))
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_c1_a_recovery_never_follows_a_users_links_to_roots_files(cluster, open_dir):
    """C1: a local user turns the job's log and its input file into links to root's files after a
    snapshot.  Before the fix the recovery truncated the root file through the link (50 -> 0 bytes)
    and the restored rank got descriptors on it and on a root-only file.  Now the recovery's plan
    refuses before anything is stopped: nothing of root's is touched, and the job trains on."""
    cc = _cluster(cluster, spares=1)
    job = open_dir / "job"
    job.mkdir()
    job.chmod(0o777)
    victim, secret = open_dir / "root-owned", open_dir / "root-only"
    victim.write_text("v" * 49 + "\n")
    victim.chmod(0o644)
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    log, data, out = job / "job.log", job / "input", job / "result"
    data.write_text("input\n")
    ranks = cluster.start_job("app", [sys.executable, str(WORKLOADS / "appender.py"), "--log", str(log), "--out",
                                      str(out), "--hold", str(data), "--steps", "500"], 1, {0: "host-b"},
                              addresses={0: cluster.worker_address(0)}, run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "app", 1)
    until(lambda: [s for s in cc.snapshots("app")["snapshots"] if s["state"] == "committed"], timeout=90,
          what="a committed snapshot")
    wait_for_step(ranks[0].log, 150)
    _as_nobody(f"rm -f {log} {data} && ln -s {victim} {log} && ln -s {secret} {data}")
    p = subprocess.run([*pitstop_cmd(), "recover", "app", "--node", "host-b", "--wait", "--json"], env=cluster.env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stdout
    op = json.loads(p.stdout)
    err = op["error"]["message"]
    assert op["metadata"]["result"] == "failed" and "is a symbolic link" in err and str(log) in err, op
    assert str(data) in err, "what CRIU would reopen is checked too, before anything stops"
    assert set(op["metadata"]["phases"]) <= {"plan"}, "refused in the plan: nothing fenced, stopped or restored"
    assert victim.read_text() == "v" * 49 + "\n" and victim.stat().st_uid == 0
    assert ranks[0].proc.wait(120) == 0, "the job trained on where it was"
    assert victim.read_text() == "v" * 49 + "\n"

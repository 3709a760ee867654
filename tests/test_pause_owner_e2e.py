"""Every pause has an owner and a deadline: a coordinator stopped in the middle of a snapshot leaves
no job stopped for good (a restarted one resumes it; an agent resumes a pause that outlived its
deadline), and `pitstop stop|kill` end ranks whatever pause they are in, their launchers with them.
Real agents and coordinator, CRIU, torch gloo with the workers' own addresses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from pitstop.dev.devcluster import pitstop_cmd, step_times
from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, until, wait_for_step
from .test_coordinator_e2e import _wait_jobs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


STEPS = 220


def _two_hosts(cluster, b_env: dict[str, str] | None = None) -> CoordinatorClient:
    from pitstop.dev.netns import NetHosts

    cluster.net = NetHosts()
    cluster.start_coordinator()
    with cluster.starting():
        cluster.start_agent("host-a")
        cluster.start_agent("host-b", env=b_env)
        cluster.start_agent("spare-1", spare=True)
    return CoordinatorClient(cluster.coordinator_url, cluster.operator_token)


def _job(cluster, cc, tmp_path, steps: int = STEPS):
    out = tmp_path / "out"
    addrs = {r: cluster.worker_address(r) for r in range(2)}
    ranks = cluster.start_job("train", ddp_cmd(out, steps=steps, step_sleep=0.05), 2, {0: "host-a", 1: "host-b"},
                              addresses=addrs, run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "train", 2)
    wait_for_step(ranks[1].log, 10)
    return out, ranks


def _taking(cc: CoordinatorClient) -> dict:
    def under_way():
        got = [s for s in cc.snapshots("train")["snapshots"] if s["state"] == "taking"]
        return got[0] if got else None
    return until(under_way, timeout=60, what="a snapshot under way", every=0.01)


def _kill_coordinator(cluster) -> int:
    port = int(cluster.coordinator_url.rsplit(":", 1)[1])
    os.killpg(cluster.coordinator_proc.pid, signal.SIGKILL)
    cluster.coordinator_proc.wait(10)
    return port


def test_a_coordinator_restarted_during_a_snapshot_resumes_the_job(cluster, tmp_path):
    """Killed while host-b dumps (the job stopped everywhere, its networks locked), started again:
    the restarted coordinator finds the snapshot it left under way, resumes every rank, lifts the
    locks and records the snapshot failed; the job ends as an uninterrupted run."""
    cc = _two_hosts(cluster, {"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": "snapshot:before_dump=sleep:3"})
    out, ranks = _job(cluster, cc, tmp_path)
    snap = _taking(cc)
    time.sleep(0.5)  # paused and locked; host-b inside its dump
    port = _kill_coordinator(cluster)
    time.sleep(2)
    t_restart = time.time()
    cluster.start_coordinator(port=port)
    got = until(lambda: next((s for s in cc.snapshots("train")["snapshots"] if s["number"] == snap["number"]
                              and s["state"] == "failed"), None), timeout=60, what="the snapshot recorded failed")
    assert "coordinator restarted" in got["error"], got
    # the restarted coordinator resumed it (the agents' own pause deadline is minutes away)
    until(lambda: [t for _, t in step_times(ranks[0].log) if t > t_restart], timeout=60,
          what="a step of rank 0 after the coordinator's restart")
    let_finish(out)
    assert [r.proc.wait(180) for r in ranks] == [0, 0]
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=STEPS))


def test_stop_and_kill_end_ranks_in_any_pause_and_their_launchers_end_too(cluster, tmp_path):
    """`pitstop stop` while the job is stopped for a snapshot, then `pitstop kill` of another job
    held the same way: every rank ends, its launcher exits with the rank's status, and nothing of
    the job reads "paused" afterwards."""
    cc = _two_hosts(cluster, {"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": "snapshot:before_dump=sleep:8"})
    _, ranks = _job(cluster, cc, tmp_path, steps=100_000)
    _taking(cc)
    time.sleep(0.5)
    p = subprocess.run([*pitstop_cmd(), "stop", "train", "--wait", "--json"], env=cluster.env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    said = json.loads(p.stdout)
    assert all(w["delivered"] for w in said["workers"]) and not said["running"], said
    codes = [r.proc.wait(60) for r in ranks]
    assert all(c != 0 for c in codes) or codes == [0, 0], codes
    states = {w["id"]: w["state"] for w in _wait_jobs(cc, "train", 0)["workers"]}
    assert "paused" not in states.values(), states

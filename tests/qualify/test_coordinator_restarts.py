"""The fault matrix's rows for a coordinator killed (SIGKILL) and started again in each phase of a
snapshot and of a recovery: no job is left stopped or half restored, and each job ends bitwise
equal to an uninterrupted run.  A snapshot the coordinator was taking is undone on every host and
recorded failed (the previous committed one still counts); a recovery it was running is run again
from its start.  The coordinator is held in the phase by a fault point (faults.py:
snapshot_phase:<name>, recovery_phase:<name>), killed inside it, and started again without it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pitstop.dev.netns import NetHosts
from pitstop.wire.coordinator_client import CoordinatorClient

from ..helpers import assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, until, wait_for_step
from ..test_coordinator_e2e import _wait_jobs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

STEPS = 220
HOLD_S = 8  # the fault holds the coordinator this long in the phase; it is killed inside it


@pytest.fixture(autouse=True)
def _settings(monkeypatch):
    monkeypatch.setenv("PITSTOP_COORDINATOR_FAILURE_DEADLINE_S", "6")
    monkeypatch.setenv("PITSTOP_AGENT_SELF_FENCE_S", "3")
    monkeypatch.setenv("PITSTOP_COORDINATOR_SNAPSHOT_PAUSE_SHARE", "1")


def _world(cluster, tmp_path, fault: str):
    cluster.net = NetHosts()
    cluster.start_coordinator(env={"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": f"{fault}=sleep:{HOLD_S}"})
    with cluster.starting():
        for name in ("host-a", "host-b", "spare-1"):
            cluster.start_agent(name, spare=name.startswith("spare"))
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    out = tmp_path / "out"
    addrs = {r: cluster.worker_address(r) for r in range(2)}
    ranks = cluster.start_job("train", ddp_cmd(out, steps=STEPS, step_sleep=0.1), 2, {0: "host-a", 1: "host-b"},
                              addresses=addrs, run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "train", 2)
    wait_for_step(ranks[0].log, 10)
    return cc, out, ranks


def _restart(cluster) -> None:
    """Killed outright (as a crashed host's), then started again, without the fault."""
    port = int(cluster.coordinator_url.rsplit(":", 1)[1])
    os.killpg(cluster.coordinator_proc.pid, signal.SIGKILL)
    cluster.coordinator_proc.wait(10)
    cluster.start_coordinator(port=port)


def _finished_intact(cluster, out, ranks, tmp_path) -> str:
    let_finish(out)
    codes = [r.proc.wait(240) for r in ranks]
    assert codes == [0, 0], codes
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=STEPS))
    return "job finished bitwise equal"


SNAPSHOT_PHASES = ("check", "pause", "lock", "dump", "resume", "replicate", "commit")


@pytest.mark.parametrize("phase", SNAPSHOT_PHASES)
def test_coordinator_killed_in_each_phase_of_a_snapshot(cluster, tmp_path, record, phase):
    cc, out, ranks = _world(cluster, tmp_path, f"snapshot_phase:{phase}")
    state = "replicating" if phase in ("replicate", "commit") else "taking"
    snap = until(lambda: next((s for s in cc.snapshots("train")["snapshots"] if s["state"] == state), None),
                 timeout=60, what=f"a snapshot {state}", every=0.02)
    time.sleep(2 if phase != "commit" else 4)  # inside the phase's hold (replication ends within 2 s)
    _restart(cluster)
    got = until(lambda: next((s for s in cc.snapshots("train")["snapshots"] if s["number"] == snap["number"]
                              and s["state"] in ("failed", "committed")), None), timeout=60,
                what="the snapshot settled by the restarted coordinator")
    ok = _finished_intact(cluster, out, ranks, tmp_path)
    record(f"coordinator killed in phase {phase} of a snapshot, restarted",
           f"snapshot {got['state']}; the job resumed; {ok}", (got.get("error") or "")[:200])


RECOVERY_PHASES = ("plan", "fence", "stop", "restore", "resume")


@pytest.mark.parametrize("phase", RECOVERY_PHASES)
def test_coordinator_killed_in_each_phase_of_a_recovery(cluster, tmp_path, record, phase):
    cc, out, ranks = _world(cluster, tmp_path, f"recovery_phase:{phase}")
    until(lambda: [s for s in cc.snapshots("train")["snapshots"] if s["state"] == "committed"], timeout=90,
          what="a committed snapshot")
    cluster.kill_host("host-b")
    op = until(lambda: next((o for o in cc.ops() if o["metadata"].get("job") == "train"
                             and o["metadata"].get("phase") == phase), None), timeout=90,
               what=f"the recovery in phase {phase}", every=0.02)
    time.sleep(1)
    _restart(cluster)
    done = until(lambda: (o := cc.op(op["name"]))["done"] and o, timeout=180, what="the recovery run again to its end")
    assert done["metadata"]["result"] == "succeeded", done
    # the rank that ran on host-b now runs on the spare; its launcher died with host-b
    let_finish(out)
    assert ranks[0].proc.wait(240) == 0
    until(lambda: (out / "rank1.sha256").exists(), timeout=120, what="the recovered rank's result")
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=STEPS))
    record(f"coordinator killed in phase {phase} of a recovery, restarted",
           f"the recovery run again from its start and succeeded onto {done['metadata']['destination']}; "
           "job finished bitwise equal", f"pause {done['metadata'].get('pause_s')} s")

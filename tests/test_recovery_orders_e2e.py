"""Unplanned failures in the order hosts often die in: the kernel (the OOM killer, a crashing driver)
kills a host's ranks first, their peers elsewhere see their connections reset and end, the host's
agent reports its ranks ended, and only then does the host go quiet.  A job with snapshots is
recovered by itself from that too, every rank rolled back to the same snapshot, DataLoader
workers included; a job that finished is never recovered.  All real: agents, coordinator, CRIU,
torch gloo with the workers' own addresses and loader worker processes, namespaces, nftables."""

from __future__ import annotations

import time

import pytest

from pitstop.dev.netns import NetHosts
from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, until, wait_for_step
from .test_coordinator_e2e import _wait_jobs
from .test_recovery_e2e import STEPS, _committed, _recovered

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


@pytest.fixture(autouse=True)
def _quicker_detection(monkeypatch):
    """As tests/test_recovery_e2e.py: a host is declared failed after 6 s of silence here."""
    monkeypatch.setenv("PITSTOP_COORDINATOR_FAILURE_DEADLINE_S", "6")
    monkeypatch.setenv("PITSTOP_AGENT_SELF_FENCE_S", "3")


@pytest.fixture(autouse=True)
def _no_multiprocessing_leftovers():
    """The same clean-up after a failed run too: a recovery that failed leaves the killed loader
    workers' directories as well, and the suite's leak check would then report those instead."""
    yield
    _multiprocessing_leftovers()


def _cluster(cluster) -> CoordinatorClient:
    cluster.net = NetHosts()
    cluster.start_coordinator()
    with cluster.starting():
        for name in ("host-a", "host-b", "spare-1"):
            cluster.start_agent(name, spare=name.startswith("spare"))
    return CoordinatorClient(cluster.coordinator_url, cluster.operator_token)


def ranks_die_first_then_their_host(cluster, tmp_path) -> dict:
    """The report's scenario: a 4-rank gloo job with 2 DataLoader workers a rank, two hosts with
    addresses of their own, a snapshot every 5 s.  Host b's ranks are killed first (their loader
    workers with them); host a's ranks end a moment later on connection resets; b's agent reports
    its ranks ended; 1.5 s later b's agent, its launchers and its link go.  Before, neither failure
    rule saw it and the job was lost 60 s later with its snapshots.  Now it is recovered by itself:
    b's ranks onto the spare from their replicas, a's ranks (ended, their launchers holding them)
    rolled back from their own parts, and it ends bitwise equal to an uninterrupted run."""
    cc = _cluster(cluster)
    out = tmp_path / "out"
    addrs = {r: cluster.worker_address(r) for r in range(4)}
    ranks = cluster.start_job("train", ddp_cmd(out, steps=STEPS, workers=2), 4,
                              {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}, addresses=addrs,
                              run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "train", 4)
    wait_for_step(ranks[0].log, 2)  # the loader workers start with the first batch
    # each part says how many processes its rank's tree had: the rank, its two loader workers and the
    # init of its own address's namespace (a snapshot taken as the job started may precede the workers)
    def whole_trees() -> dict | None:
        return next((s for s in reversed(cc.snapshots("train")["snapshots"]) if s["state"] == "committed"
                     and all(p.get("processes") == 4 for p in s["parts"].values())), None)
    first = until(whole_trees, timeout=90, what="a snapshot of every rank with its loader workers")
    snap = _committed(cc, "train", after=first["number"])
    assert snap["incremental"], "with loader workers too, the next snapshot is a delta"
    assert {w: p["processes"] for w, p in snap["parts"].items()} == {f"train.{r}": 4 for r in range(4)}, snap["parts"]
    # ... and where the agent's time in the pause went
    assert all({"criu", "track_reset", "seal_and_files"} <= set(p["steps"]) for p in snap["parts"].values()), snap
    wait_for_step(ranks[0].log, 60)
    lost = cluster.kill_host("host-b", processes_first_s=1.5)
    assert sorted(lost) == ["train.2", "train.3"]
    m = _recovered(cc, "train", "host-b")
    assert m["destination"] == "spare-1" and m["lost_ranks"] == [2, 3], m
    # found by the rule for ranks that ended first (every one of b's ranks failed at once while it was still
    # heard), or by the one for a host whose ranks ended and then went silent: whichever sees it first
    assert m["requested_by"].startswith("the coordinator (ranks failed"), m
    assert m["detected_after_s"] is not None and m["detected_after_s"] < 30, m
    let_finish(out)
    assert [r.proc.wait(240) for r in ranks[:2]] == [0, 0], "host-a's launchers followed their restored ranks"
    until(lambda: all((out / f"rank{r}.sha256").exists() for r in range(4)), timeout=120,
          what="every rank's result, the moved ones' too")
    assert_same_as_reference(out, reference_hashes(tmp_path, 4, steps=STEPS))
    _multiprocessing_leftovers()
    return {"recovery": m}


def _multiprocessing_leftovers() -> None:
    """The loader workers killed with their host leave Python multiprocessing's temporary
    directories (pymp-*), as any process killed outright would: removed here, once the job ended."""
    import shutil
    import tempfile
    from pathlib import Path

    for d in Path(tempfile.gettempdir()).glob("pymp-*"):
        shutil.rmtree(d, ignore_errors=True)


def a_finished_job_is_never_recovered(cluster, tmp_path) -> dict:
    """A job with snapshots that finished (every rank exited 0), whose host then dies: no recovery,
    and its snapshots are dropped as those of a job that ended (not kept as a failed one's)."""
    cc = _cluster(cluster)
    out = tmp_path / "out"
    addrs = {r: cluster.worker_address(r) for r in range(2)}
    ranks = cluster.start_job("done", ddp_cmd(out, steps=120, step_sleep=0.05), 2, {0: "host-a", 1: "host-b"},
                              addresses=addrs, run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "done", 2)
    _committed(cc, "done")
    let_finish(out)
    assert [r.proc.wait(120) for r in ranks] == [0, 0]
    until(lambda: next(j for j in cc.jobs() if j["job"] == "done")["state"] == "finished", timeout=30,
          what="the job read finished")
    cluster.kill_host("host-b")
    time.sleep(12)  # past the failure deadline (6 s), twice
    ops = [o for o in cc.ops() if o["metadata"].get("job") == "done"]
    assert ops == [], ops
    assert cc.snapshots("done")["kept"] is None, "a finished job's snapshot is not kept for a recovery"
    return {}


def test_ranks_killed_then_agent_then_link_recover_with_loader_workers(cluster, tmp_path):
    ranks_die_first_then_their_host(cluster, tmp_path)


def test_a_finished_job_whose_host_dies_is_not_recovered(cluster, tmp_path):
    a_finished_job_is_never_recovered(cluster, tmp_path)

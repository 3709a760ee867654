"""Unplanned failures: a job with in-memory snapshots loses a host without warning (its agent and
workers SIGKILLed, its link cut) and recovers by itself onto a spare, every rank rolled back to
the same snapshot, with final parameters bitwise equal to an uninterrupted run.  All real:
agents, coordinator, CRIU, torch gloo with workers' own addresses, namespaces, nftables."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from pitstop.dev.devcluster import step_times
from pitstop.dev.netns import NetHosts
from pitstop.wire.agent_client import AgentClient
from pitstop.wire.coordinator_client import CoordinatorClient
from pitstop.wire.worker_report import WorkerReport

from .helpers import assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, until, wait_for_step
from .test_coordinator_e2e import _wait_jobs
from .test_worker_network_e2e import _cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


@pytest.fixture(autouse=True)
def _quicker_detection(monkeypatch):
    """A host is declared failed after 6 s of silence here, not 10 (its agent isolates itself after
    3, not 6): the same rules, a shorter wait in each of these tests.  bench/recovery.py keeps the
    defaults."""
    monkeypatch.setenv("PITSTOP_COORDINATOR_FAILURE_DEADLINE_S", "6")
    monkeypatch.setenv("PITSTOP_AGENT_SELF_FENCE_S", "3")

# Each scenario is a function that returns what it saw: the tests below run them, and `make qualify`
# runs them again as rows of its fault matrix (tests/qualify/test_recovery_faults.py).

STEPS = 220  # as tests/test_worker_network_e2e.py's 4-rank job: one uninterrupted reference run for both


def _committed(cc: CoordinatorClient, job: str, after: int = 0) -> dict:
    def done():
        snaps = [s for s in cc.snapshots(job)["snapshots"] if s["state"] == "committed" and s["number"] > after]
        return snaps[-1] if snaps else None
    return until(done, timeout=90, what=f"a committed snapshot of {job} after {after}")


def _kill_host(cluster, name: str, ranks=None) -> list[str]:
    return cluster.kill_host(name)


def _train_with_snapshots(cluster, cc: CoordinatorClient, tmp_path, step_sleep: float = 0.05):
    """The 4-rank gloo DDP job, ranks 0-1 on host-a and 2-3 on host-b with their own addresses, a
    snapshot every 5 s; returned once it trains (its output directory and ranks).  step_sleep: its
    pace until let_finish (a slower one for a test that needs it running longer; the result is the
    same)."""
    out = tmp_path / "out"
    addrs = {r: cluster.worker_address(r) for r in range(4)}
    ranks = cluster.start_job("train", ddp_cmd(out, steps=STEPS, step_sleep=step_sleep), 4,
                              {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}, addresses=addrs,
                              run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "train", 4)
    wait_for_step(ranks[3].log, 10)
    return out, ranks


def _hashes_written(out, world: int) -> bool:
    return all((out / f"rank{r}.sha256").exists() for r in range(world))


def _during_a_snapshot(cc: CoordinatorClient, job: str, after: int) -> dict:
    """Wait until a snapshot of `job` newer than `after` is being taken (the job paused for it)."""
    def under_way():
        got = [s for s in cc.snapshots(job)["snapshots"] if s["number"] > after and s["state"] == "taking"]
        return got[0] if got else None
    return until(under_way, timeout=60, what=f"a snapshot of {job} under way", every=0.01)


def host_dies_during_a_snapshot(cluster, tmp_path) -> dict:
    """Host b dies outright while a snapshot is under way: that snapshot never counts, the previous one
    is used.  The first spare dies too, in the middle of the recovery's restore: the recovery takes
    the other.  Then b's agent comes back: fenced."""
    cluster.net = NetHosts()
    cluster.start_coordinator()
    with cluster.starting():
        cluster.start_agent("host-a")
        # b's dumps wait a while (a fault): the test kills it inside one, before its part exists
        cluster.start_agent("host-b", env={"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": "snapshot:before_dump=sleep:1"})
        # spare-1's restore waits a while (a fault): the test kills the host in it
        cluster.start_agent("spare-1", spare=True,
                            env={"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": "snapshot:before_restore=sleep:4"})
        cluster.start_agent("spare-2", spare=True)
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    out, ranks = _train_with_snapshots(cluster, cc, tmp_path)
    snap = _committed(cc, "train")
    # a buddy per host, spares first: each host's replica where a recovery may restore it
    assert snap["buddies"] == {"host-a": "spare-1", "host-b": "spare-2"}, snap
    assert snap["pause"] == "sigstop" and snap["pause_s"] > 0 and snap["bytes"] > 0
    snap = _committed(cc, "train", after=snap["number"])  # a second one, and the first dropped
    assert [s["number"] for s in cc.snapshots("train")["snapshots"]] == [snap["number"]]
    wait_for_step(ranks[0].log, 60)
    under_way = _during_a_snapshot(cc, "train", after=snap["number"])
    time.sleep(0.4)  # past the check and the pause: host-b waits before its dump (the fault)
    snap = max((s for s in cc.snapshots("train")["snapshots"] if s["state"] == "committed"), key=lambda s: s["number"])
    assert snap["number"] < under_way["number"]
    lost = _kill_host(cluster, "host-b", ranks)
    assert sorted(lost) == ["train.2", "train.3"]
    until(lambda: next((o for o in cc.ops() if o["metadata"].get("job") == "train"
                        and o["metadata"].get("phase") == "restore"), None), timeout=60, what="the recovery restoring",
          every=0.05)
    time.sleep(0.5)  # inside spare-1's restore (it waits 4 s before CRIU: the fault)
    _kill_host(cluster, "spare-1")

    m = _recovered(cc, "train", "host-b")
    assert m["snapshot"] == snap["number"], "the snapshot the host died in never counted"
    assert m["destination"] == "spare-2" and [f["spare"] for f in m["spares_failed"]] == ["spare-1"], m
    # it went silent in the restore: abandoned then, not at the call's own deadline, and fenced, so that
    # what it restored is ended if it ever comes back
    assert "spare-1 went silent" in m["spares_failed"][0]["error"] and m["spares_failed"][0]["fenced"], m
    assert m["lost_ranks"] == [2, 3]
    assert set(m["phases"]) >= {"plan", "fence", "stop", "restore", "resume"}
    assert m["requested_by"].startswith("the coordinator")
    hosts = {w["rank"]: w["host"] for w in _wait_jobs(cc, "train", 4)["workers"]}
    assert hosts == {0: "host-a", 1: "host-a", 2: "spare-2", 3: "spare-2"}

    # host-b comes back after the recovery (its agent restarted, its ranks died with it): it is told of
    # the fence before anything else, runs nothing of the job, and its reports move no rank back
    cluster.net.cut("host-b", up=True)
    cluster.start_agent("host-b", port=int(cluster.agents["host-b"].url.rsplit(":", 1)[1]))
    assert until(lambda: [f["acked"] for f in cc.snapshots("train")["fences"] if f["host"] == "host-b"] == [True],
                 timeout=30, what="the fence acknowledged by host-b's agent")
    assert not [w for w in _agent_workers(cluster, "host-b").values() if w.state in ("running", "paused")]
    assert {w["rank"]: w["host"] for w in _wait_jobs(cc, "train", 4)["workers"]} == hosts

    let_finish(out)
    for r in ranks[:2]:  # the survivors' launchers followed their rolled-back ranks
        assert r.proc.wait(240) == 0, r.log.read_text(errors="replace")[-2000:]
    until(lambda: _hashes_written(out, 4), timeout=240, what="every rank's final parameters")
    assert_same_as_reference(out, reference_hashes(tmp_path, 4, steps=STEPS))
    print(f"\nrecovery: pause {m['pause_s']:.2f} s, work redone {m['lost_s']:.1f} s, phases {m['phases']}; "
          f"snapshot pause {snap['pause_s']:.2f} s for {snap['bytes'] / 2**20:.0f} MiB")
    return {"recovery": m, "snapshot": snap, "during": under_way["number"]}


def nccl_host_dies(cluster, tmp_path) -> dict:
    """The same with an unchanged NCCL program over the host NCCL: snapshots at the shim's consistent
    cut (communicators destroyed, no own addresses needed), communicators re-created after the recovery.
    The first spare's restore fails (an injected fault): it is emptied and the next one taken."""
    from .test_shim_e2e import STEPS as NCCL_STEPS
    from .test_shim_e2e import _start, reference

    cc, ranks, out = _start(cluster, tmp_path, "nccl_dp.py", run_args=("--snapshot-every", "5"), spares=2,
                            agent_env={"spare-1": {"PITSTOP_ENABLE_FAULTS": "1",
                                                   "PITSTOP_FAULTS": "snapshot:before_restore=fail"}})
    _wait_jobs(cc, "nccl", 4)
    wait_for_step(ranks[3].log, 20)
    snap = _committed(cc, "nccl")
    assert snap["pause"] == "nccl_cut", snap
    wait_for_step(ranks[0].log, 60)
    lost = _kill_host(cluster, "host-b", ranks)
    reached = max(s for s, _ in step_times(ranks[0].log))
    kept = cc.snapshots("nccl")["snapshots"]  # the one the recovery uses is among them (none commits now)
    assert sorted(lost) == ["nccl.2", "nccl.3"]
    m = _recovered(cc, "nccl", "host-b")
    assert m["destination"] == "spare-2" and "rewire" in m["phases"], m
    # the steps it redoes, counted from the shims' NCCL calls, against the job's own step lines
    used = next(s for s in kept if s["number"] == m["snapshot"])
    def step_at(when: float) -> int:
        return max((s for s, t in step_times(ranks[0].log) if t <= when), default=0)
    # the cut fell somewhere between the snapshot's start and its end
    first, last = step_at(used["created"]), step_at(used["created"] + used["seconds"])
    assert m["steps_redone"] is not None, m.get("steps_redone_why")
    assert reached - last - 1 <= m["steps_redone"] <= reached - first + 1, (m["steps_redone"], reached, first, last)
    assert [f["spare"] for f in m["spares_failed"]] == ["spare-1"] and "injected fault" in m["spares_failed"][0]["error"]
    assert not [w for w in _agent_workers(cluster, "spare-1").values() if w.state in ("running", "paused")], \
        "the failed spare keeps nothing of the job"
    let_finish(out)
    for r in ranks[:2]:
        assert r.proc.wait(180) == 0, r.log.read_text(errors="replace")[-2000:]
    until(lambda: _hashes_written(out, 4), timeout=180, what="every rank's final result")
    assert_same_as_reference(out, reference("nccl_dp.py"))
    assert NCCL_STEPS > 0
    cluster.net.cut("host-b", up=True)
    return {"recovery": m, "snapshot": snap}


def _dies_processes_first(cluster, name: str) -> list[str]:
    """Host `name` dies with its processes going before its link (the kernel took them, then the host
    went down): its agent and its ranks SIGKILLed while the link is up, so that their connections
    close and the survivors' next collective fails at once; then the link cut and its launchers
    killed, as kill_host does.  The ids of the workers it ran."""
    import signal

    ws = [w for w in _agent_workers(cluster, name).values() if w.state in ("running", "paused")]
    a = cluster.agents[name]
    a.proc.kill()
    a.proc.wait(10)
    for w in ws:
        subprocess.run(["pkill", "-KILL", "-s", str(os.getsid(w.root_pid))], capture_output=True, timeout=10)
    time.sleep(0.5)  # their connections' ends reach the survivors
    cluster.net.cut(name)
    for r in cluster.ranks:
        if r.agent == name and r.proc.poll() is None:
            os.killpg(r.proc.pid, signal.SIGKILL)
    return [w.id for w in ws]


def nccl_survivors_park(cluster, tmp_path) -> dict:
    """The NCCL job (unchanged program, host NCCL, the shim) with snapshots; host b dies, its processes
    before its link, so that the surviving ranks' all-reduces fail at once with ncclRemoteError: the
    case in which they used to end.  Covered by a committed snapshot (their agent told their shims),
    they do not end: each parks in its shim, alive, its agent reports it, and the recovery rolls the
    live processes back from their own parts, as it rolls back ranks that ended.  The job ends bitwise
    equal to an uninterrupted run."""
    from .helpers import pace_file
    from .test_shim_e2e import _start, reference

    steps = 800  # paced at 0.05 s a step until let_finish: two snapshots and a failure to outlast
    pace_file(tmp_path / "out").write_text("0.05\n")
    cc, ranks, out = _start(cluster, tmp_path, "nccl_dp.py", steps=steps, run_args=("--snapshot-every", "5"))
    _wait_jobs(cc, "nccl", 4)
    wait_for_step(ranks[3].log, 20)
    first = _committed(cc, "nccl")
    survivors = ["nccl.0", "nccl.1"]

    def shims() -> dict[str, list[dict]]:
        with AgentClient(cluster.agents["host-a"].url, cluster.token) as c:
            return c.shim_blocks_many(survivors)
    until(lambda: all(b["protect"] >= first["number"] for bs in shims().values() for b in bs), timeout=30,
          what="the survivors' shims told of the committed snapshot")
    snap = _committed(cc, "nccl", after=first["number"])  # right after a commit: no snapshot under way when b dies
    pids = {w: _agent_workers(cluster, "host-a")[w].root_pid for w in survivors}
    lost = _dies_processes_first(cluster, "host-b")
    assert sorted(lost) == ["nccl.2", "nccl.3"]

    def parked():
        got = shims()
        held = {w: next((b["lost"] for b in got[w] if (b["lost"] or {}).get("state") == "parked"), None)
                for w in survivors}
        return held if all(held.values()) else None
    held = until(parked, timeout=30, what="both survivors parked on their lost peers", every=0.05)
    assert all(h["error"] == "ncclRemoteError" and h["call"] == "ncclAllReduce" for h in held.values()), held
    for w, pid in pids.items():  # alive, and their launchers hold them: nothing ended
        os.kill(pid, 0)
    assert all(r.proc.poll() is None for r in ranks[:2])
    reported = until(lambda: {w.id: w for w in _agent_workers(cluster, "host-a").values()
                              if (w.peer_lost or "").startswith("parked on a peer's failure")},
                     timeout=30, what="host-a's agent reporting its parked ranks", every=0.1)
    assert sorted(reported) == survivors and all(w.state == "running" for w in reported.values()), reported

    m = _recovered(cc, "nccl", "host-b")
    assert m["snapshot"] >= snap["number"] and m["destination"] == "spare-1" and "rewire" in m["phases"], m
    assert {w: s["state"] for w, s in m["survivors"].items()} == {w: "parked" for w in survivors}, m["survivors"]
    assert all(s["error"] == "ncclRemoteError" for s in m["survivors"].values()), m["survivors"]
    after = _agent_workers(cluster, "host-a")
    assert all(after[w].root_pid != pids[w] for w in survivors), "the parked processes were rolled back"
    let_finish(out)
    for r in ranks[:2]:  # their launchers followed the rolled-back ranks
        assert r.proc.wait(180) == 0, r.log.read_text(errors="replace")[-2000:]
    until(lambda: _hashes_written(out, 4), timeout=180, what="every rank's final result")
    assert_same_as_reference(out, reference("nccl_dp.py", steps))
    cluster.net.cut("host-b", up=True)
    return {"recovery": m, "snapshot": snap, "parked": held}


def _recovered(cc: CoordinatorClient, job: str, node: str, timeout: float = 120) -> dict:
    op = until(lambda: next((o for o in cc.ops() if o["metadata"].get("job") == job and o["metadata"]["node"] == node
                             and o["done"]), None), timeout=timeout, what=f"the recovery of {job} from {node}")
    assert op["metadata"]["result"] == "succeeded", op
    return op["metadata"]


def _agent_workers(cluster, name: str) -> dict[str, WorkerReport]:
    with AgentClient(cluster.agents[name].url, cluster.token) as c:
        return {w.id: w for w in c.workers()}


RACKS = {"host-a": "rack-1", "host-b": "rack-2", "spare-1": "rack-1", "spare-2": "rack-2"}


def _racked(cluster, names: list[str], faults: dict[str, dict[str, str]] | None = None) -> CoordinatorClient:
    """A coordinator and the agents `names`, each in its failure domain (RACKS); `faults`: more
    environment for some of them."""
    cluster.net = NetHosts()
    cluster.start_coordinator()
    with cluster.starting():
        for name in names:
            cluster.start_agent(name, spare=name.startswith("spare"),
                                env={"PITSTOP_AGENT_FAILURE_DOMAIN": RACKS[name], **(faults or {}).get(name, {})})
    return CoordinatorClient(cluster.coordinator_url, cluster.operator_token)


def partitioned_host_back_during_the_recovery_then_a_second_failure(cluster, tmp_path) -> dict:
    """Host b is cut off, not killed: its agent isolates its ranks (stopped, network locked) while the
    job recovers on spare-1.  b comes back while the recovery restores (spare-1's restore delayed by
    a fault): its ranks are ended (fenced), never rejoin, and the recovery goes on.  Then spare-1,
    which now runs ranks 2 and 3, dies outright: the job recovers again, onto spare-2."""
    cc = _racked(cluster, ["host-a", "host-b", "spare-1", "spare-2"],
                 faults={"spare-1": {"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": "snapshot:before_restore=sleep:8"}})
    out, ranks = _train_with_snapshots(cluster, cc, tmp_path, step_sleep=0.08)  # two failures to outlast
    snap = _committed(cc, "train")
    # each host's replica in the other rack (spares taken in turn would put host-a's on spare-1, its own rack)
    assert snap["buddies"] == {"host-a": "spare-2", "host-b": "spare-1"}, snap
    assert snap["buddy_why"]["host-a"] == "a spare outside failure domain rack-1", snap
    cluster.net.cut("host-b")  # a partition: b's agent and ranks run on, unreachable
    op = until(lambda: next((o for o in cc.ops() if o["metadata"].get("job") == "train"
                             and o["metadata"].get("phase") == "restore"), None), timeout=90,
               what="the recovery restoring", every=0.05)
    assert not op["done"]
    cluster.net.cut("host-b", up=True)  # b is back while spare-1 restores its ranks

    def fenced():
        ws = _agent_workers(cluster, "host-b")
        return all(ws[w].state in ("lost", "exited") for w in ("train.2", "train.3")) and ws
    ws = until(fenced, timeout=60, what="host-b's ranks ended once it is back")
    assert "fenced" in ws["train.2"].reason, ws["train.2"]
    assert not cc.op(op["name"])["done"], "b's ranks were ended during the recovery, not after it"
    m1 = _recovered(cc, "train", "host-b")
    assert m1["destination"] == "spare-1" and m1["lost_ranks"] == [2, 3]
    assert until(lambda: all(f["acked"] for f in cc.snapshots("train")["fences"]), timeout=30,
                 what="the fence acknowledged")
    hosts = {w["rank"]: w["host"] for w in _wait_jobs(cc, "train", 4)["workers"]}
    assert hosts == {0: "host-a", 1: "host-a", 2: "spare-1", 3: "spare-1"}, "a fenced host's reports are ignored"

    snap = _committed(cc, "train", after=m1["snapshot"])  # taken after the recovery, over host-a and spare-1
    assert set(snap["buddies"]) == {"host-a", "spare-1"} and snap["buddies"]["spare-1"] != "spare-1"
    lost = _kill_host(cluster, "spare-1", ranks)
    assert sorted(lost) == ["train.2", "train.3"]
    m2 = _recovered(cc, "train", "spare-1")
    assert m2["destination"] == "spare-2" and m2["snapshot"] >= snap["number"]

    let_finish(out)
    for r in ranks[:2]:
        assert r.proc.wait(240) == 0, r.log.read_text(errors="replace")[-2000:]
    until(lambda: _hashes_written(out, 4), timeout=240, what="every rank's final parameters")
    assert_same_as_reference(out, reference_hashes(tmp_path, 4, steps=STEPS))
    for r in ranks[2:]:  # their launchers on host-b followed them until they were fenced there
        assert r.proc.wait(30) != 0
    cluster.net.cut("spare-1", up=True)
    return {"first": m1, "second": m2, "fenced": ws["train.2"].reason}


def ranks_fail_at_once_on_a_live_host(cluster, tmp_path) -> dict:
    """Host b keeps its agent, but both of its ranks die at once (SIGKILLed, as when its GPU falls
    off the bus); host a's ranks fail a moment later, their collectives broken.  The coordinator
    takes b for lost (its ranks failed first), fences it and recovers the job onto the spare."""
    cc = _cluster(cluster, spares=1)
    out, ranks = _train_with_snapshots(cluster, cc, tmp_path)
    _committed(cc, "train")
    ws = _agent_workers(cluster, "host-b")
    for wid in ("train.2", "train.3"):
        subprocess.run(["pkill", "-KILL", "-s", str(os.getsid(ws[wid].root_pid))], timeout=10)
    m = _recovered(cc, "train", "host-b", timeout=60)
    assert m["requested_by"].startswith("the coordinator (ranks failed") and "host-b" in m["requested_by"], m
    assert m["destination"] == "spare-1" and m["lost_ranks"] == [2, 3] and m["fenced_now"], m
    hosts = {w["rank"]: w["host"] for w in _wait_jobs(cc, "train", 4)["workers"]}
    assert hosts == {0: "host-a", 1: "host-a", 2: "spare-1", 3: "spare-1"}
    let_finish(out)
    for r in ranks[:2]:
        assert r.proc.wait(240) == 0, r.log.read_text(errors="replace")[-2000:]
    until(lambda: _hashes_written(out, 4), timeout=240, what="every rank's final parameters")
    assert_same_as_reference(out, reference_hashes(tmp_path, 4, steps=STEPS))
    for r in ranks[2:]:  # their launchers on host-b: their ranks were fenced there
        assert r.proc.wait(60) != 0
    return {"recovery": m}


def replicas_lost_with_their_host(cluster, tmp_path) -> dict:
    """Host b and the buddy that held its replicas die together: the recovery fails saying the job
    must restart from its own checkpoint, before it stops anything, and is not tried again."""
    cc = _cluster(cluster, spares=1)
    out = tmp_path / "out"
    addrs = {r: cluster.worker_address(r) for r in range(2)}
    ranks = cluster.start_job("pair", ddp_cmd(out, steps=STEPS), 2, {0: "host-a", 1: "host-b"}, addresses=addrs,
                              run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "pair", 2)
    snap = _committed(cc, "pair")
    assert snap["buddies"]["host-b"] == "spare-1"
    before = _agent_workers(cluster, "host-a")["pair.0"]
    _kill_host(cluster, "host-b", ranks)
    _kill_host(cluster, "spare-1", ranks)
    op = until(lambda: next((o for o in cc.ops() if o["metadata"].get("job") == "pair" and o["done"]), None),
               timeout=120, what="the recovery to end")
    assert op["metadata"]["result"] == "failed"
    assert op["error"]["code"] == "unrecoverable"
    assert "lost with it" in op["error"]["message"] and "own checkpoint" in op["error"]["action"]
    assert op["metadata"]["phase"] == "plan", "it failed before it stopped anything"
    after = _agent_workers(cluster, "host-a")["pair.0"]
    assert after.root_pid == before.root_pid and after.state == "running"
    time.sleep(3)
    assert len([o for o in cc.ops() if o["metadata"].get("job") == "pair"]) == 1, "not tried again by itself"
    assert cc.snapshots("pair")["snapshots"] == []
    cluster.net.cut("host-b", up=True)
    cluster.net.cut("spare-1", up=True)
    return {"error": op["error"]}


def buddy_changes_to_a_spare_that_joins(cluster, tmp_path) -> dict:
    """Host a's replica is kept by host b (the only spare shares a's rack) until a spare in another
    rack joins: a better buddy.  The new buddy holds none of the parts a delta would be against, so
    the coordinator asks host a for whole parts in that snapshot: it commits (no snapshot fails on
    the change), and the next one is a delta again, against the part the new buddy holds."""
    cc = _racked(cluster, ["host-a", "host-b", "spare-1"])
    out = tmp_path / "out"
    addrs = {r: cluster.worker_address(r) for r in range(2)}
    # paced until let_finish: five snapshots 5 s apart must find it running (220 steps ended at the
    # fourth on a busy machine)
    ranks = cluster.start_job("pair", ddp_cmd(out, steps=1200), 2, {0: "host-a", 1: "host-b"}, addresses=addrs,
                              run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "pair", 2)
    first = _committed(cc, "pair")
    assert first["buddies"] == {"host-a": "host-b", "host-b": "spare-1"}, first
    before = _committed(cc, "pair", after=first["number"])  # a delta for each part, the tracking started
    assert sorted(before["incremental"]) == ["pair.0", "pair.1"], before
    with cluster.starting():
        cluster.start_agent("spare-2", spare=True, env={"PITSTOP_AGENT_FAILURE_DOMAIN": RACKS["spare-2"]})

    def changed():
        got = cc.snapshots("pair")
        assert not got["last_error"], f"a snapshot failed: {got['last_error']}"
        new = [s for s in got["snapshots"] if s["state"] == "committed" and s["buddies"].get("host-a") == "spare-2"]
        return new[0] if new else None
    snap = until(changed, timeout=60, what="a snapshot with host a's replica on the new spare", every=0.1)
    assert snap["whole"] == {"host-a": "its buddy changed from host-b to spare-2"}, snap
    assert "pair.0" not in snap["incremental"] and "pair.1" in snap["incremental"], snap
    assert snap["buddies"]["host-b"] == "spare-1", "a buddy still among the best is kept"
    after = _committed(cc, "pair", after=snap["number"])
    assert after["whole"] == {} and sorted(after["incremental"]) == ["pair.0", "pair.1"], after
    let_finish(out)
    assert [r.proc.wait(120) for r in ranks] == [0, 0]
    return {"whole": snap, "next": after}


def operator_recovers_a_live_host_with_an_appended_log(cluster, tmp_path) -> dict:
    """`pitstop recover JOB --node HOST --wait --json` by hand, the host still up: its copy of the rank
    is fenced before anything is restored, and the log the job keeps open and appends to is cut
    back to the snapshot, so that it ends as an uninterrupted run's, line for line."""
    import json
    import sys

    from pitstop.dev.devcluster import pitstop_cmd

    from .helpers import WORKLOADS

    cc = _cluster(cluster, spares=1)
    log, out = tmp_path / "job.log", tmp_path / "result"
    ranks = cluster.start_job("app", [sys.executable, str(WORKLOADS / "appender.py"), "--log", str(log), "--out", str(out),
                                      "--steps", "400"], 1, {0: "host-b"},
                              addresses={0: cluster.worker_address(0)}, run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "app", 1)
    snap = _committed(cc, "app")
    wait_for_step(ranks[0].log, 250)
    p = subprocess.run([*pitstop_cmd(), "recover", "app", "--node", "host-b", "--wait", "--json"], env=cluster.env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    op = json.loads(p.stdout)
    m = op["metadata"]
    assert op["done"] and m["result"] == "succeeded" and m["requested_by"] == "an operator", op
    assert m["fenced_now"] and m["snapshot"] >= snap["number"] and m["destination"] == "spare-1"
    assert [f["path"] for f in m["files"]["cut_back"]] == [str(log)], m
    assert any(o["name"] == op["name"] for o in json.loads(subprocess.run(
        [*pitstop_cmd(), "ops", "--json"], env=cluster.env(), capture_output=True, text=True, timeout=60).stdout))
    assert ranks[0].proc.wait(30) != 0, "its launcher on host-b saw its copy fenced"
    until(lambda: out.exists(), timeout=120, what="the job's result")
    total = 0
    want = []
    for step in range(1, 401):
        total = (total * 31 + step) % 1_000_003
        want.append(f"step {step} {total}")
    assert log.read_text().splitlines() == want
    assert out.read_text().strip() == str(total)
    return {"recovery": m}


def snapshot_over_its_budget(cluster, tmp_path) -> dict:
    """A host whose snapshot budget is too small for the job's ranks refuses the snapshot at the
    check, before any rank pauses, and says so with the numbers; the job trains on unpaused."""
    import sys

    from pitstop.dev.devcluster import step_gaps

    from .helpers import WORKLOADS

    cluster.net = NetHosts()
    cluster.start_coordinator()
    with cluster.starting():
        cluster.start_agent("host-a")
        cluster.start_agent("host-b", env={"PITSTOP_AGENT_SNAPSHOT_BUDGET_MB": "1"})
        cluster.start_agent("spare-1", spare=True)
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    log, out = tmp_path / "job.log", tmp_path / "result"
    ranks = cluster.start_job("small", [sys.executable, str(WORKLOADS / "appender.py"), "--log", str(log), "--out",
                                        str(out), "--steps", "300", "--step-sleep", "0.02"], 1, {0: "host-b"},
                              addresses={0: cluster.worker_address(0)}, run_args=["--snapshot-every", "5"])
    _wait_jobs(cc, "small", 1)
    t0 = time.time()
    err = until(lambda: cc.snapshots("small").get("last_error"), timeout=30, what="the refusal")
    assert "budget of 1 MiB" in err and "host-b" in err, err
    assert [s for s in cc.snapshots("small")["snapshots"] if s["state"] == "committed"] == []
    assert ranks[0].proc.wait(60) == 0
    assert max(step_gaps(ranks[0].log, since=t0)) < 0.3, "the job never paused for it"
    return {"error": err}


def test_gloo_job_recovers_by_itself_from_a_host_that_died_during_a_snapshot(cluster, tmp_path):
    host_dies_during_a_snapshot(cluster, tmp_path)


def test_nccl_job_recovers_by_itself_from_a_host_that_died(cluster, tmp_path):
    nccl_host_dies(cluster, tmp_path)


def test_nccl_survivors_of_a_host_that_died_park_for_the_recovery_instead_of_ending(cluster, tmp_path):
    nccl_survivors_park(cluster, tmp_path)


def test_a_partitioned_host_back_during_the_recovery_is_fenced_and_a_second_failure_recovers_too(cluster, tmp_path):
    partitioned_host_back_during_the_recovery_then_a_second_failure(cluster, tmp_path)


def test_a_host_whose_ranks_all_fail_at_once_is_recovered_like_a_dead_one(cluster, tmp_path):
    ranks_fail_at_once_on_a_live_host(cluster, tmp_path)


def test_replicas_lost_with_their_host_fail_the_recovery_and_change_nothing(cluster, tmp_path):
    replicas_lost_with_their_host(cluster, tmp_path)


def test_a_buddy_that_changes_gets_whole_parts_and_no_snapshot_fails(cluster, tmp_path):
    buddy_changes_to_a_spare_that_joins(cluster, tmp_path)


def test_a_log_the_job_appends_to_is_cut_back_when_an_operator_recovers_it(cluster, tmp_path):
    operator_recovers_a_live_host_with_an_appended_log(cluster, tmp_path)


def test_a_snapshot_over_its_budget_is_refused_before_the_job_pauses(cluster, tmp_path):
    snapshot_over_its_budget(cluster, tmp_path)

"""Slurm drains, pitstop moves: a real Slurm (tests/slurm_cluster.py: slurmctld and a slurmd for
nodes a, b and spare1), real agents, a 4-rank gloo DDP job started with `srun ... pitstop run`, and
`pitstop slurm-watch` as an operator would run it.  No pitstop command is given to move anything."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time

import pytest

from pitstop.dev.devcluster import free_port, pitstop_cmd
from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import WORKLOADS, assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, until, wait_for_step
from .slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
# The jobs must outlive every check the tests make while they run (a drain, a move, a cancel, a
# second drain): paced at 0.1 s a step, 1,000 steps last minutes on a busy machine, and once the
# checks are done the rest run at full speed (let_finish).  At 80 steps a job whose ranks compute
# on one thread each ended before the move's checks (it had lasted only because four ranks of two
# spinning threads each were slow on two cores).
STEPS = 1000
STEP_SLEEP = 0.1
SLEEPER = [sys.executable, str(WORKLOADS / "sleeper.py"), "300"]


@pytest.fixture
def slurm():
    c = SlurmCluster(["a", "b", "spare1"])
    try:
        yield c
    finally:
        c.close()


def _note(slurm, name):
    return slurm.node(name)["reason"]


def _pitstop(cluster):
    """A coordinator, agents for Slurm nodes a and b, and a spare for node spare1."""
    cluster.start_coordinator()
    with cluster.starting():
        for host, node in (("host-a", "a"), ("host-b", "b")):
            cluster.start_agent(host, env={"PITSTOP_AGENT_SLURM_NODE": node})
        cluster.start_agent("spare-1", spare=True, env={"PITSTOP_AGENT_SLURM_NODE": "spare1"})
    cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
    until(lambda: {h.get("slurm_node") for h in cc.hosts()} == {"a", "b", "spare1"}, what="agents report their nodes")
    return cc


def _agent_files(cluster, tmp_path):
    """Each node's agent URL in a file named for the node: a Slurm task reads its own by $SLURMD_NODENAME."""
    agents = tmp_path / "agents"
    agents.mkdir()
    for host, node in (("host-a", "a"), ("host-b", "b")):
        (agents / node).write_text(cluster.agents[host].url)
    return agents


def _watch(cluster, slurm, tmp_path, *args):
    return subprocess.Popen([*pitstop_cmd(), "slurm-watch", "--coordinator", cluster.coordinator_url,
                             "--interval", "0.3", *args], env=slurm.env(cluster.env()),
                            stdout=open(tmp_path / "slurm-watch.log", "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _stop(p):
    if p is None or p.poll() is not None:
        return
    p.terminate()
    try:
        p.wait(15)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(5)


def test_a_drain_in_slurm_moves_the_ranks_with_no_pitstop_command(cluster, slurm, tmp_path):
    cc = _pitstop(cluster)
    watch = _watch(cluster, slurm, tmp_path)
    job = idle = None
    try:
        # the spare is held back from Slurm's ordinary jobs
        until(lambda: "spare1" in slurm.run("scontrol", "-o", "show", "reservation", "pitstop_spares",
                                            check=False).stdout, what="the spares' reservation")
        other = slurm.run("srun", "-w", "spare1", "--immediate=3", "true", check=False)
        assert other.returncode != 0 and "reserved" in other.stderr, other.stderr
        # the job, as a Slurm user starts it: each task runs `pitstop run` with its node's agent
        agents = _agent_files(cluster, tmp_path)
        out = tmp_path / "out"
        task = (f'exec {shlex.join(pitstop_cmd())} run --job train --agent "$(cat {agents}/$SLURMD_NODENAME)" -- '
                f'{shlex.join(ddp_cmd(out, steps=STEPS, step_sleep=STEP_SLEEP))}')
        env = slurm.env(cluster.env())
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        job = subprocess.Popen(["srun", "-N2", "-n4", "--ntasks-per-node=2", "-w", "a,b",
                                f"--output={tmp_path}/train.rank%t.log", "sh", "-c", task], env=env,
                               stdout=open(tmp_path / "srun.log", "ab"), stderr=subprocess.STDOUT,
                               start_new_session=True)
        idle_task = (f'exec {shlex.join(pitstop_cmd())} run --job idle --agent "$(cat {agents}/$SLURMD_NODENAME)" '
                     f'-- {shlex.join(SLEEPER)}')
        idle = subprocess.Popen(["srun", "-N2", "-n2", "--ntasks-per-node=1", "-w", "a,b", "--job-name=idle",
                                 f"--output={tmp_path}/idle.rank%t.log", "sh", "-c", idle_task], env=env,
                                stdout=open(tmp_path / "idle-srun.log", "ab"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        wait_for_step(tmp_path / "train.rank3.log", 5)
        until(lambda: len([w for j in cc.jobs() if j["job"] == "idle" for w in j["workers"]
                           if w["state"] == "running"]) == 2, what="the idle job's two ranks")
        ranks = {w["rank"]: w["host"] for j in cc.jobs() if j["job"] == "train" for w in j["workers"]}
        assert ranks == {0: "host-a", 1: "host-a", 2: "host-b", 3: "host-b"}, ranks  # SLURM_PROCID
        # the operator drains b in Slurm, and does nothing else
        slurm.run("scontrol", "update", "nodename=b", "state=drain", "reason=maintenance")
        until(lambda: "pitstop: moved its ranks to spare-1" in _note(slurm, "b"), timeout=180,
              what=f"the move, as b's reason says it: {_note(slurm, 'b')!r}")
        assert _note(slurm, "b").startswith("maintenance | pitstop: moved its ranks to spare-1 (operations/")
        op = next(o for o in cc.ops(node="host-b"))
        assert op["metadata"]["result"] == "succeeded" and "Slurm drain of b" in op["metadata"]["reason"], op
        def running():
            return {w["rank"]: w["host"] for j in cc.jobs() if j["job"] == "train" for w in j["workers"]
                    if w["state"] == "running"}
        until(lambda: running() == {0: "host-a", 1: "host-a", 2: "spare-1", 3: "spare-1"},
              what="ranks 2 and 3 on the spare, 0 and 1 where they were (as the agents report)")
        # the spare is the job's now: in its allocation, with a step holding each moved rank
        (train_id,) = slurm.run("squeue", "-h", "--name=sh", "-o", "%i").stdout.split()
        until(lambda: f"spare1 added to job {train_id}" in _note(slurm, "b"), what="the spare joined the job")
        assert slurm.run("squeue", "-h", "-j", train_id, "-o", "%N").stdout.strip() == "a,b,spare1"
        steps = slurm.run("squeue", "-h", "-s", "-j", train_id, "-o", "%j %N").stdout.split("\n")
        assert {"pitstop-hold-train.2 spare1", "pitstop-hold-train.3 spare1"} <= set(steps), steps
        # scancel of a job whose rank moved ends every rank, the moved one on the spare included
        assert {w["host"] for j in cc.jobs() if j["job"] == "idle" for w in j["workers"]
                if w["state"] == "running"} == {"host-a", "spare-1"}
        slurm.run("scancel", "--name=idle")
        idle.wait(60)
        until(lambda: not [w for j in cc.jobs() if j["job"] == "idle" for w in j["workers"]
                           if w["state"] in ("running", "paused")], timeout=30,
              what="every rank of the cancelled job ended, wherever it ran")
        # a drain whose ranks cannot move (no spare left) leaves them running and says why
        slurm.run("scontrol", "update", "nodename=a", "state=drain", "reason=maintenance")
        until(lambda: "pitstop: cannot move its ranks" in _note(slurm, "a"), what="a's reason")
        assert "they run here still" in _note(slurm, "a")
        assert running() == {0: "host-a", 1: "host-a", 2: "spare-1", 3: "spare-1"}
        # the node that took the ranks stays held back while it runs them
        assert "spare1" in slurm.run("scontrol", "-o", "show", "reservation", "pitstop_spares").stdout
        slurm.run("scontrol", "update", "nodename=a", "state=resume")
        let_finish(out)
        assert job.wait(180) == 0, (tmp_path / "srun.log").read_text(errors="replace")[-2000:]
        assert_same_as_reference(out, reference_hashes(tmp_path, 4, steps=STEPS))
    finally:
        _stop(idle)
        _stop(job)
        _stop(watch)


def test_a_released_node_leaves_the_job_and_can_reboot(cluster, slurm, tmp_path):
    """`slurm-watch --release-nodes`: once b's ranks moved, b leaves the jobs' allocations and ends
    DRAINED with no job, and the spare joins them.  A 2-rank torch DDP job finishes bitwise equal
    with its rank 1 on the spare; the moved rank of an idle job outlives its launcher on b (Slurm
    ended it), runs as a step of its job on the spare, and a scancel of that job ends it there."""
    cc = _pitstop(cluster)
    watch = _watch(cluster, slurm, tmp_path, "--release-nodes")
    train = idle = None
    try:
        agents = _agent_files(cluster, tmp_path)
        env = slurm.env(cluster.env())
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k, None)
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        out = tmp_path / "out"

        def srun(name, cmd):
            task = (f'exec {shlex.join(pitstop_cmd())} run --job {name} --agent "$(cat {agents}/$SLURMD_NODENAME)" '
                    f'-- {shlex.join(cmd)}')
            return subprocess.Popen(["srun", "-N2", "-n2", "--ntasks-per-node=1", "-w", "a,b", f"--job-name={name}",
                                     f"--output={tmp_path}/{name}.rank%t.log", "sh", "-c", task], env=env,
                                    stdout=open(tmp_path / f"{name}-srun.log", "ab"), stderr=subprocess.STDOUT,
                                    start_new_session=True)
        train = srun("train", ddp_cmd(out, steps=STEPS, step_sleep=STEP_SLEEP))
        idle = srun("idle", SLEEPER)

        def running(job):
            return {w["rank"]: w["host"] for j in cc.jobs() if j["job"] == job for w in j["workers"]
                    if w["state"] == "running"}
        wait_for_step(tmp_path / "train.rank1.log", 5)
        until(lambda: running("idle") == {0: "host-a", 1: "host-b"}, what="the idle job's two ranks")
        ids = {name: slurm.run("squeue", "-h", f"--name={name}", "-o", "%i").stdout.strip() for name in ("train", "idle")}
        assert {w.get("slurm_job") for j in cc.jobs() for w in j["workers"]} == set(ids.values())
        slurm.run("scontrol", "update", "nodename=b", "state=drain", "reason=maintenance")
        until(lambda: all(f"spare1 added to job {i}" in _note(slurm, "b") for i in ids.values()), timeout=120,
              what="b moved and freed, the spare added to both jobs")
        for i in ids.values():
            assert f"freed from job {i}" in _note(slurm, "b"), _note(slurm, "b")
        # b has no job left: DRAINED, it could reboot; each job runs on a and the spare, its rank 1 there
        until(lambda: slurm.node("b")["state"] == "idle" and "DRAIN" in slurm.node("b")["state_flags"],
              what="b drained with no job")
        for name, i in ids.items():
            assert slurm.run("squeue", "-h", "-j", i, "-o", "%N").stdout.strip() == "a,spare1"
            assert "NodeList=a,spare1" in slurm.run("scontrol", "show", "job", i).stdout
            steps = slurm.run("squeue", "-h", "-s", "-j", i, "-o", "%j %N").stdout.split("\n")
            assert f"pitstop-hold-{name}.1 spare1" in steps, steps  # the moved rank is a step of its job there
            until(lambda name=name: running(name) == {0: "host-a", 1: "spare-1"}, what=f"{name}'s rank 1 on the spare")
        time.sleep(1.0)
        assert running("idle") == {0: "host-a", 1: "spare-1"}  # its launcher on b is gone; it is not
        let_finish(out)
        # the price of freeing b, written down: Slurm killed the job's task there, and its srun says so
        assert train.wait(180) == 137, (tmp_path / "train-srun.log").read_text(errors="replace")[-2000:]
        assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=STEPS))
        # scancel, with no watcher left to help: the idle rank on a ends with its task, the moved one
        # with its step on the spare
        _stop(watch)
        slurm.run("scancel", ids["idle"])
        until(lambda: not running("idle"), timeout=30, what="every rank of the cancelled job ended")
        idle.wait(60)
        # slurmctld lists a cancelled step until its slurmd reports it gone: a moment after its tasks end
        until(lambda: not slurm.run("squeue", "-h", "-s", "-o", "%i").stdout.strip(), timeout=30,
              what="no step of any job left in squeue")
    finally:
        _stop(idle)
        _stop(train)
        _stop(watch)

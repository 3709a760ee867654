"""The job's handle follows its ranks (agent/handles.py), all real processes: a signal sent to the
launcher of a rank that moved reaches the rank on the spare; a launcher killed outright ends a
rank that still runs beside it; an evacuated host can lose its agent and its launchers (as a
reboot would) and the job still finishes, bitwise equal; an operator ends a job wherever its ranks
run (`pitstop stop|kill JOB`); `srun`'s variables give the rank and world."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pitstop.dev.devcluster import pitstop_cmd
from pitstop.proc import proctree
from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import WORKLOADS, assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, until, wait_for_step

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
SLEEPER = [sys.executable, str(WORKLOADS / "sleeper.py"), "120"]


def _cluster(cluster):
    cluster.start_coordinator()
    with cluster.starting():
        cluster.start_agent("host-a")
        cluster.start_agent("host-b")
        cluster.start_agent("spare-1", spare=True)
    return CoordinatorClient(cluster.coordinator_url, cluster.operator_token)


def _worker(cluster, agent, wid):
    return next((w for w in cluster.agents[agent].client().workers() if w.id == wid), None)


def _evacuated(cc, host):
    op = cc.evacuate(host)
    end = time.monotonic() + 240
    while not op["done"] and time.monotonic() < end:
        time.sleep(0.05)
        op = cc.op(op["name"])
    assert op["done"] and op["metadata"]["result"] == "succeeded", op
    return op


def _cli(cluster, *args, timeout=120):
    return subprocess.run([*pitstop_cmd(), *args], env=cluster.env(), capture_output=True, text=True,
                          timeout=timeout)


def test_a_signal_to_the_launcher_reaches_the_rank_that_moved(cluster):
    cc = _cluster(cluster)
    ranks = cluster.start_job("h", SLEEPER, 1, {0: "host-a"})
    cluster.wait_registered("host-a", "h.0")
    until(lambda: b"tick 3" in ranks[0].log.read_bytes(), what="the rank ticks")
    op = _evacuated(cc, "host-a")
    w = _worker(cluster, "spare-1", "h.0")
    assert w.state == "running" and w.restored, w
    # the ledger has it; a job whose collectives the shim does not count shows no progress, and says so
    m = until(lambda: next((x for x in cc.moves() if x["operation"] == op["name"] and x["after_move"]), None),
              what="the ledger's entry")
    assert not m["after_move"]["measured"] and "gloo" in m["after_move"]["why_not"], m
    # ... but its pause, from the capture stopping it to its restore on the spare, by the agents' clocks
    assert 0 < m["rank_pause_s"]["h.0"] <= op["metadata"]["downtime_s"] + 0.05, m
    assert m["result"] == "succeeded" and m["decision"]["destination"] == "spare-1"
    r = subprocess.run([*pitstop_cmd(), "moves", "--node", "host-a"], env=dict(cluster.env(), COLUMNS="250"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "host-a -> spare-1" in r.stdout and "not measured" in r.stdout, r.stdout + r.stderr
    # the fleet replay prices a history with this coordinator's measured moves
    (trace := cluster.root / "trace.csv").write_text("time_h,host,kind,domain\n1,host-a,planned,rack-1\n")
    r = _cli(cluster, "replay", str(trace), "--hosts", "2", "--moves-from", cluster.coordinator_url, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["given"]["pitstop.planned_s"]["value"] == op["metadata"]["downtime_s"]
    assert all(s["costs"]["pitstop"]["planned_s"] == op["metadata"]["downtime_s"] for s in d["stacks"].values())
    ranks[0].proc.send_signal(signal.SIGTERM)  # as a scheduler's cancel or Ctrl-C would
    # the launcher passes it to its agent, which passes it to the spare's: the rank dies of it there,
    # and the launcher exits as the rank did (128 + 15)
    assert ranks[0].proc.wait(60) == 128 + signal.SIGTERM
    until(lambda: _worker(cluster, "spare-1", "h.0").state == "exited", what="the moved rank ended")
    assert not proctree.exists(w.root_pid)


def test_a_launcher_killed_outright_ends_the_rank_beside_it(cluster):
    _cluster(cluster)
    ranks = cluster.start_job("k", SLEEPER, 1, {0: "host-b"})
    w = cluster.wait_registered("host-b", "k.0")
    assert w.launcher["pid"] == ranks[0].proc.pid, w
    tree = proctree.tree(w.root_pid)
    ranks[0].proc.kill()  # SIGKILL: nothing can be passed on; the agent sees the launcher go
    ranks[0].proc.wait(10)
    w = until(lambda: (x := _worker(cluster, "host-b", "k.0")) and x.state == "exited" and x,
              timeout=15, what="the agent ended the rank of a launcher that died")
    assert w.exit_code == 128 + signal.SIGKILL and "launcher" in w.reason, w
    until(lambda: not any(proctree.exists(p) for p in tree), timeout=10, what="the rank's processes are gone")


def test_a_moved_ranks_handle_is_taken_up_where_it_runs_now(cluster, tmp_path):
    """`pitstop hold` on the spare takes the place of the launcher left on the evacuated host (what
    the Slurm watcher starts as a step of the job there): it shows the rank's output, passes it a
    SIGTERM and exits with its status; killed outright, it ends the rank, as a launcher would.  A
    second holder, or one on a host where the rank does not run, is refused."""
    cc = _cluster(cluster)
    ranks = cluster.start_job("t", SLEEPER, 2, {0: "host-b", 1: "host-b"})
    for r in (0, 1):
        cluster.wait_registered("host-b", f"t.{r}")
    _evacuated(cc, "host-b")
    for rk in ranks:  # the evacuated host reboots: its launchers are gone
        rk.proc.kill()
        rk.proc.wait(10)
    r = _cli(cluster, "hold", "t.0", "--agent", cluster.agents["host-a"].url)
    assert r.returncode == 125 and "no worker 't.0'" in r.stderr, r.stderr
    spare = cluster.agents["spare-1"].url
    holders = [subprocess.Popen([*pitstop_cmd(), "hold", f"t.{r}", "--agent", spare], env=cluster.env(),
                                stdout=open(tmp_path / f"hold{r}.out", "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True) for r in (0, 1)]
    try:
        for r, h in enumerate(holders):
            until(lambda r=r, h=h: (_worker(cluster, "spare-1", f"t.{r}").launcher or {}).get("pid") == h.pid,
                  what=f"the holder of t.{r} took up its handle")
        r = _cli(cluster, "hold", "t.0", "--agent", spare)
        assert r.returncode == 125 and "already has a launcher on this host" in r.stderr, r.stderr
        until(lambda: b"tick" in (tmp_path / "hold0.out").read_bytes(), what="the rank's output through its holder")
        holders[0].send_signal(signal.SIGTERM)  # as scancel does to a step
        assert holders[0].wait(60) == 128 + signal.SIGTERM
        w = until(lambda: (x := _worker(cluster, "spare-1", "t.0")) and x.state == "exited" and x,
                  what="the rank ended by its holder's signal")
        assert w.exit_code == 128 + signal.SIGTERM, w
        holders[1].kill()  # SIGKILL: nothing passed on; the agent sees its holder go
        holders[1].wait(10)
        w = until(lambda: (x := _worker(cluster, "spare-1", "t.1")) and x.state == "exited" and x,
                  timeout=15, what="the rank of a holder that died")
        assert w.exit_code == 128 + signal.SIGKILL and "launcher" in w.reason, w
    finally:
        for h in holders:
            if h.poll() is None:
                h.kill()
                h.wait(10)


def test_the_evacuated_host_can_go_and_the_operator_ends_moved_ranks(cluster, tmp_path):
    """host-b is evacuated, then its agent stops and its launcher is killed (as a reboot would):
    the moved rank goes on, `pitstop attach` gives its output and exit status to whoever lost the
    launcher, and the 2-rank job finishes bitwise equal.  A second job is then ended
    by the operator, wherever its ranks run."""
    cc = _cluster(cluster)
    out = tmp_path / "out"
    train = cluster.start_job("train", ddp_cmd(out, steps=80), 2, {0: "host-a", 1: "host-b"})
    idle = cluster.start_job("idle", SLEEPER, 2, {0: "host-a", 1: "host-b"})
    wait_for_step(train[1].log, 5)
    cluster.wait_registered("host-b", "idle.1")
    _evacuated(cc, "host-b")
    cluster.stop_agent("host-b", signal.SIGKILL)
    for rk in (train[1], idle[1]):
        rk.proc.kill()
        rk.proc.wait(10)
    spare = cluster.agents["spare-1"].client()
    seen = len(spare.output("train.1", "stdout", 0)[0])
    # whoever held the killed launcher takes the job's handle back through the coordinator
    attach_out = tmp_path / "attach.out"
    attach = subprocess.Popen([*pitstop_cmd(), "attach", "train.1"], env=cluster.env(),
                              stdout=open(attach_out, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    let_finish(out)
    assert train[0].proc.wait(180) == 0, train[0].log.read_text(errors="replace")[-2000:]
    w = until(lambda: (x := _worker(cluster, "spare-1", "train.1")) and x.state == "exited" and x,
              timeout=60, what="the moved rank finished on the spare")
    assert w.exit_code == 0, w
    assert len(spare.output("train.1", "stdout", 0)[0]) > seen  # it went on writing there
    assert attach.wait(60) == 0  # the rank's exit status
    said = attach_out.read_text(errors="replace")
    assert "done rank=1 steps=80" in said, said[-2000:]
    r = _cli(cluster, "attach", "nope.3")
    assert r.returncode == 1 and "no worker 'nope.3'" in r.stderr and "pitstop jobs" in r.stderr, r.stderr
    assert_same_as_reference(out, reference_hashes(tmp_path, 2, steps=80))
    # `pitstop stop`: SIGTERM to every rank of the job, the one on host-a and the one on the spare
    r = _cli(cluster, "stop", "idle", "--wait", "--timeout", "60", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    said = json.loads(r.stdout)
    assert {(w["worker"], w["host"], w["delivered"]) for w in said["workers"]} == \
        {("idle.0", "host-a", True), ("idle.1", "spare-1", True)}, said
    assert not said["running"]
    assert idle[0].proc.wait(30) == 128 + signal.SIGTERM
    until(lambda: _worker(cluster, "spare-1", "idle.1").state == "exited", what="the moved idle rank ended")
    # a job with nothing running: said plainly, nothing signalled
    r = _cli(cluster, "kill", "idle")
    assert r.returncode == 1 and "no running ranks" in r.stderr and "pitstop jobs" in r.stderr, r.stderr
    r = _cli(cluster, "stop", "idle", "--signal", "NOPE")
    assert r.returncode == 2 and "unknown signal" in r.stderr, r.stderr


def test_a_launcher_follows_its_moved_rank_through_the_coordinator_once_its_agent_is_gone(cluster):
    """host-b is evacuated and its agent stopped (docs allow it); its launcher stays, as a scheduler's
    step does.  Before, it printed nothing more, ignored SIGTERM and exited 255 ten minutes later
    ("lost contact"), though the rank ran on.  Now it follows the rank with the handle its agent gave
    it: the rank's output keeps coming, its signal reaches the rank, and it exits as the rank did."""
    cc = _cluster(cluster)
    ranks = cluster.start_job("f", SLEEPER, 1, {0: "host-b"})
    cluster.wait_registered("host-b", "f.0")
    until(lambda: b"tick 3" in ranks[0].log.read_bytes(), what="the rank ticks")
    _evacuated(cc, "host-b")
    cluster.stop_agent("host-b")
    cluster.agents["host-b"].proc.wait(30)
    seen = ranks[0].log.read_bytes().count(b"tick ")
    until(lambda: b"following worker f.0 through the coordinator" in ranks[0].log.read_bytes(), timeout=30,
          what="the launcher turning to the coordinator")
    until(lambda: ranks[0].log.read_bytes().count(b"tick ") > seen + 5, timeout=30,
          what="the moved rank's output through the coordinator")
    assert ranks[0].proc.poll() is None
    ranks[0].proc.send_signal(signal.SIGTERM)
    assert ranks[0].proc.wait(60) == 128 + signal.SIGTERM
    until(lambda: _worker(cluster, "spare-1", "f.0").state == "exited", what="the moved rank ended")


def test_under_srun_the_rank_and_world_come_from_slurm(cluster, tmp_path):
    """`srun pitstop run -- python train.py`: no RANK or WORLD_SIZE, only Slurm's variables; and a
    rank registered twice, on one host or on two, is refused saying where it runs."""
    _cluster(cluster)
    a = cluster.agents["host-a"]
    env = {k: v for k, v in cluster.env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")}
    env.update(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_LOCALID="1")
    show = ["sh", "-c", 'echo "rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK"; sleep 30']
    p = subprocess.Popen([*pitstop_cmd(), "run", "--job", "s", "--agent", a.url, "--", *show], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        w = cluster.wait_registered("host-a", "s.1")
        assert w.rank == 1 and w.world == 2, w
        assert p.stdout.readline().decode().strip() == "rank=1 world=2 local=1"
        # the same rank of the same job a second time on this host is refused, and said why
        twin = subprocess.run([*pitstop_cmd(), "run", "--job", "s", "--agent", a.url, "--", "sleep", "30"],
                              env=env, capture_output=True, text=True, timeout=60)
        assert twin.returncode == 125 and "s.1 is already registered" in twin.stderr, twin.stderr
        # ... and on another host too: the coordinator knows where it runs
        b = cluster.agents["host-b"]
        twin = subprocess.run([*pitstop_cmd(), "run", "--job", "s", "--agent", b.url, "--", "sleep", "30"],
                              env=env, capture_output=True, text=True, timeout=60)
        assert twin.returncode == 125 and "rank 1 of job s already runs on host-a" in twin.stderr, twin.stderr
        assert "SLURM_PROCID" in twin.stderr
        bad = subprocess.run([*pitstop_cmd(), "run", "--job", "s", "--agent", a.url, "--", "true"],
                             env=dict(env, SLURM_PROCID="2"), capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "not below the job's 2 ranks" in bad.stderr, bad.stderr
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)

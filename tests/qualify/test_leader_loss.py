"""The fault matrix's rows for two coordinators on a real PostgreSQL (tests/postgres.py), one
leading: the leader killed (SIGKILL, as its host dying) in each phase of an evacuation and of a
recovery; the leader cut off from the database while the agents still reach it; the leader stalled
(SIGSTOP, a frozen VM) past its lease and woken up after the standby took over; the database
restarted mid-operation; both coordinators started at once.

The invariant is the one of every row of the matrix: the job ends bitwise equal to an
uninterrupted run, and what the operation says is what happened: the new leader finishes an
evacuation past its commit point and rolls back one before it, runs a recovery again from its
start; the old leader acts no more.  The leader is held in the phase by a fault point
(faults.py), killed inside it; the standby runs without the fault.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from pitstop.wire.coordinator_client import CoordinatorClient

from ..helpers import assert_same_as_reference, ddp_cmd, let_finish, reference_hashes, until, wait_for_step
from ..tcpproxy import TcpProxy
from ..test_coordinator_e2e import _wait_jobs, _wait_op

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

EVAC_STEPS = 160
RECOVERY_STEPS = 220
HOLD_S = 8  # the fault holds the leader this long in the phase; it is killed inside it


def _role(url: str) -> str | None:
    """A coordinator's role as it says it; None while it does not answer (restarting)."""
    try:
        return httpx.get(url + "/v1/leader", timeout=5).json().get("role")
    except httpx.HTTPError:
        return None


def _faults(spec: str) -> dict[str, str]:
    return {"PITSTOP_ENABLE_FAULTS": "1", "PITSTOP_FAULTS": spec}


class World:
    """Two coordinators on one database, the first leading (started first, with `fault`), three
    agents that know both, a 2-rank DDP job on host-a and host-b."""

    def __init__(self, cluster, tmp_path, pg_url: str, fault: str = "", leader_db: str | None = None,
                 snapshots: bool = False, steps: int = EVAC_STEPS, agent_env: dict[str, str] | None = None) -> None:
        self.c, self.tmp, self.steps = cluster, tmp_path, steps
        if snapshots:
            from pitstop.dev.netns import NetHosts

            cluster.net = NetHosts()
        self.leader, self.standby = cluster.start_coordinators(
            [leader_db or pg_url, pg_url], envs=[_faults(fault) if fault else {}, {}], at_once=False)
        assert cluster.leader() is self.leader
        with cluster.starting():
            for name in ("host-a", "host-b", "spare-1"):
                cluster.start_agent(name, spare=name.startswith("spare"),
                                    env=agent_env if name == "host-b" else None)
        self.cc = CoordinatorClient(cluster.coordinator_url, cluster.operator_token)
        self.out = tmp_path / "out"
        if snapshots:
            addrs = {r: cluster.worker_address(r) for r in range(2)}
            self.ranks = cluster.start_job("train", ddp_cmd(self.out, steps=steps, step_sleep=0.1), 2,
                                           {0: "host-a", 1: "host-b"}, addresses=addrs,
                                           run_args=["--snapshot-every", "5"])
        else:
            self.ranks = cluster.start_job("train", ddp_cmd(self.out, steps=steps), 2, {0: "host-a", 1: "host-b"})
        _wait_jobs(self.cc, "train", 2)
        wait_for_step(self.ranks[1].log, 10)
        self.term = self.view(self.leader)["term"]

    def view(self, c) -> dict:  # noqa: ANN001
        return httpx.get(c.url + "/v1/leader", timeout=5).json()

    def kill_leader(self) -> float:
        """SIGKILL, as a host that loses power; when."""
        t = time.monotonic()
        os.killpg(self.leader.proc.pid, signal.SIGKILL)
        self.leader.proc.wait(10)
        return t

    def took_over(self, since: float) -> float:
        """Seconds from `since` until the standby leads, with the next term."""
        until(lambda: self.c.leader() is self.standby, timeout=20, what="the standby takes over")
        took = time.monotonic() - since
        assert self.view(self.standby)["term"] > self.term
        return took

    def resumed_by_the_standby(self, op: dict) -> str:
        cond = {c["type"]: c for c in op["metadata"].get("conditions", [])}.get("Resumed")
        assert cond and self.standby.url in cond["message"], op["metadata"].get("conditions")
        return cond["message"]

    def finished_intact(self) -> str:
        let_finish(self.out)
        codes = [r.proc.wait(240) for r in self.ranks]
        assert codes == [0, 0], {r.rank: r.log.read_text(errors="replace")[-1200:] for r in self.ranks}
        assert_same_as_reference(self.out, reference_hashes(self.tmp, 2, steps=self.steps))
        job = next(j for j in self.cc.jobs() if j["job"] == "train")
        hosts = {w["rank"]: w["host"] for w in job["workers"]}
        return f"job finished bitwise equal, rank 1 on {hosts[1]}"


EVACUATION_PHASES = ("precopy", "pause", "capture", "verify", "release", "restore", "commit", "resume")


@pytest.mark.parametrize("phase", EVACUATION_PHASES)
def test_leader_killed_in_each_phase_of_an_evacuation(cluster, tmp_path, pg_url, record, phase):
    w = World(cluster, tmp_path, pg_url, fault=f"phase:{phase}=sleep:{HOLD_S}")
    op = _wait_op(w.cc, w.cc.evacuate("host-b")["name"], timeout=120, until=lambda o: o["metadata"]["phase"] == phase)
    took = w.took_over(w.kill_leader())
    op = _wait_op(w.cc, op["name"])
    before_commit = phase not in ("commit", "resume")
    assert op["metadata"]["result"] == ("failed" if before_commit else "succeeded"), op.get("error")
    if before_commit:
        d = op["error"]["details"][0]
        assert d["reason"] == "coordinator_restarted" and not (d.get("metadata") or {}).get("rollback_problems"), d
    how = w.resumed_by_the_standby(op)
    outcome = w.finished_intact()
    record(f"leader killed in phase {phase} of an evacuation (two coordinators, PostgreSQL)",
           f"the standby took over in {took:.1f} s and {'rolled it back' if before_commit else 'finished it'}; "
           + outcome, how[:200])


RECOVERY_PHASES = ("plan", "fence", "stop", "restore", "resume")


@pytest.mark.parametrize("phase", RECOVERY_PHASES)
def test_leader_killed_in_each_phase_of_a_recovery(cluster, tmp_path, pg_url, record, monkeypatch, phase):
    monkeypatch.setenv("PITSTOP_COORDINATOR_FAILURE_DEADLINE_S", "6")
    monkeypatch.setenv("PITSTOP_AGENT_SELF_FENCE_S", "3")
    monkeypatch.setenv("PITSTOP_COORDINATOR_SNAPSHOT_PAUSE_SHARE", "1")
    w = World(cluster, tmp_path, pg_url, fault=f"recovery_phase:{phase}=sleep:{HOLD_S}", snapshots=True,
              steps=RECOVERY_STEPS)
    until(lambda: [s for s in w.cc.snapshots("train")["snapshots"] if s["state"] == "committed"], timeout=90,
          what="a committed snapshot")
    cluster.kill_host("host-b")
    op = until(lambda: next((o for o in w.cc.ops() if o["metadata"].get("job") == "train"
                             and o["metadata"].get("phase") == phase), None), timeout=90,
               what=f"the recovery in phase {phase}", every=0.02)
    time.sleep(1)
    took = w.took_over(w.kill_leader())
    done = until(lambda: (o := w.cc.op(op["name"]))["done"] and o, timeout=180,
                 what="the recovery run again to its end by the new leader")
    assert done["metadata"]["result"] == "succeeded", done
    let_finish(w.out)
    assert w.ranks[0].proc.wait(240) == 0
    until(lambda: (w.out / "rank1.sha256").exists(), timeout=120, what="the recovered rank's result")
    assert_same_as_reference(w.out, reference_hashes(tmp_path, 2, steps=RECOVERY_STEPS))
    record(f"leader killed in phase {phase} of a recovery (two coordinators, PostgreSQL)",
           f"the standby took over in {took:.1f} s, ran the recovery again from its start onto "
           f"{done['metadata']['destination']}; job finished bitwise equal", f"pause {done['metadata'].get('pause_s')} s")


def test_leader_cut_off_from_the_database_stops_acting(cluster, tmp_path, postgres, pg_url, record):
    """The leader reaches its database through a relay the test cuts: a partition between the two,
    while the agents and the standby reach both.  The leader stops acting at its lease's deadline
    (before the standby can take the lease), starts again as a standby, cannot reach the database
    and stops; the standby rolls the evacuation back; nothing the old leader does reaches an agent."""
    proxy = TcpProxy(("127.0.0.1", postgres.port))
    try:
        w = World(cluster, tmp_path, pg_url, leader_db=proxy.url(pg_url),
                  agent_env=_faults(f"capture:before_dump=sleep:{HOLD_S}"))
        op = _wait_op(w.cc, w.cc.evacuate("host-b")["name"], timeout=120,
                      until=lambda o: o["metadata"]["phase"] == "capture")
        t0 = time.monotonic()
        proxy.cut()
        took = w.took_over(t0)
        until(lambda: "no longer the leader" in w.leader.log.read_text(errors="replace"), timeout=20,
              what="the old leader says it stepped down")
        op = _wait_op(w.cc, op["name"])
        assert op["metadata"]["result"] == "failed", op
        d = op["error"]["details"][0]
        assert not (d.get("metadata") or {}).get("rollback_problems"), d
        how = w.resumed_by_the_standby(op)
        refused = sum(a.client().info()["coordinator_term"]["refused"] for a in cluster.agents.values())
        # the old leader started again as a standby and could not open its database: it stopped
        until(lambda: w.leader.proc.poll() is not None, timeout=30, what="the cut-off coordinator stops")
        log = w.leader.log.read_text(errors="replace")
        assert "cannot open the database" in log, log[-2000:]
        outcome = w.finished_intact()
        record("leader cut off from the database (agents still reach it), an evacuation in its capture",
               f"it stopped acting at its lease's deadline; the standby took over in {took:.1f} s and rolled the "
               f"evacuation back; {refused} call(s) of the old term reached an agent (refused); " + outcome,
               how[:160])
    finally:
        proxy.close()


def test_leader_stalled_past_its_lease_is_fenced_by_the_agents(cluster, tmp_path, pg_url, record):
    """The leader freezes (SIGSTOP: a VM paused, a process stalled) mid-capture, past its lease; the
    standby takes over, tells the agents its term and rolls the evacuation back.  Woken up, the old
    leader's threads go on where they were: whatever reaches an agent carries the old term and is
    refused; its writes carry a term the database no longer holds; it starts again as a standby."""
    w = World(cluster, tmp_path, pg_url, agent_env=_faults(f"capture:before_dump=sleep:{HOLD_S}"))
    op = _wait_op(w.cc, w.cc.evacuate("host-b")["name"], timeout=120,
                  until=lambda o: o["metadata"]["phase"] == "capture")
    t0 = time.monotonic()
    os.killpg(w.leader.proc.pid, signal.SIGSTOP)
    try:
        took = w.took_over(t0)
        op = _wait_op(w.cc, op["name"])
    finally:
        os.killpg(w.leader.proc.pid, signal.SIGCONT)
    assert op["metadata"]["result"] == "failed", op
    how = w.resumed_by_the_standby(op)
    until(lambda: "no longer the leader" in w.leader.log.read_text(errors="replace"), timeout=30,
          what="the woken leader steps down")
    until(lambda: _role(w.leader.url) == "standby", timeout=60,
          what="the old leader back as a standby (it starts again: refused connections meanwhile)")
    after = _wait_op(w.cc, op["name"])
    assert after["metadata"]["result"] == "failed" and after["metadata"]["update_time"] == op["metadata"]["update_time"], \
        "the woken leader wrote to an operation the new one had finished"
    refused = sum(a.client().info()["coordinator_term"]["refused"] for a in cluster.agents.values())
    outcome = w.finished_intact()
    record("leader stalled (SIGSTOP) past its lease mid-capture, then woken after the standby took over",
           f"the standby took over in {took:.1f} s and rolled back; the woken leader stepped down, {refused} call(s) "
           "of its term refused by the agents, nothing of it written; " + outcome, how[:160])


def test_database_restarted_mid_operation(cluster, tmp_path, postgres, pg_url, record):
    """PostgreSQL restarts (a fast shutdown: every connection ended) while the leader waits on a
    capture: a write that meets the restart fails, the evacuation is rolled back (or, where no write
    fell in the gap, it goes on and succeeds); one coordinator leads after it."""
    w = World(cluster, tmp_path, pg_url, agent_env=_faults(f"capture:before_dump=sleep:{HOLD_S}"))
    op = _wait_op(w.cc, w.cc.evacuate("host-b")["name"], timeout=120,
                  until=lambda o: o["metadata"]["phase"] == "capture")
    t0 = time.monotonic()
    postgres.restart(mode="fast", down_s=1.0)
    down = time.monotonic() - t0
    op = _wait_op(w.cc, op["name"])
    assert op["metadata"]["result"] in ("failed", "succeeded"), op
    if op["metadata"]["result"] == "failed":
        d = op["error"]["details"][0]
        assert not (d.get("metadata") or {}).get("rollback_problems"), d
    lead = until(cluster.leader, timeout=20, what="one coordinator leads after the restart")
    assert sum(1 for c in cluster.coordinators if c.proc.poll() is None
               and httpx.get(c.url + "/v1/leader", timeout=5).json()["role"] == "leader") == 1
    outcome = w.finished_intact()
    record("the database (PostgreSQL) restarted mid-evacuation, during the capture",
           f"database down {down:.1f} s; op {op['metadata']['result']}"
           f"{' (rolled back)' if op['metadata']['result'] == 'failed' else ''}; "
           f"{'the same' if lead is w.leader else 'the other'} coordinator leads after; " + outcome,
           ((op.get("error") or {}).get("message") or "succeeded")[:200])


def test_coordinators_started_at_once_elect_one_leader(cluster, pg_url, record):
    coords = cluster.start_coordinators([pg_url] * 3)  # side by side, on a database none has touched
    lead = until(cluster.leader, timeout=20, what="a leader")
    roles = [httpx.get(c.url + "/v1/leader", timeout=5).json() for c in coords]
    assert sorted(r["role"] for r in roles) == ["leader", "standby", "standby"], roles
    assert {r["leader"] for r in roles} == {lead.url} and {r["term"] for r in roles} == {1}, roles
    record("three coordinators started at once on a new database", "one leader (term 1), two standbys naming it",
           f"leader {lead.url}")

"""The decisions of `pitstop slurm-watch` (slurm/watch.py), against a Slurm and a coordinator
played by fakes: which drains start a move, what the node's reason says as it goes, the undrain
rule, the reservation, health drains, a restarted watcher.  The real Slurm, agents and job run
in test_slurm_e2e.py."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field, replace

import pytest

from pitstop.errors import Conflict, FailedPrecondition
from pitstop.slurm import watch
from pitstop.slurm.slurmctl import Job, Node, SlurmError
from pitstop.slurm.watch import OURS, Watcher, split_reason


@pytest.fixture(autouse=True)
def _quick_hold(monkeypatch):
    monkeypatch.setattr(watch, "HOLD_SETTLE_S", 0.0)


def node(name: str, drained: bool = False, reason: str = "", at: int = 0, extra: str = "") -> Node:
    return Node(name=name, state="mixed", flags=("DRAIN",) if drained else (), reason=reason,
                reason_changed_at=at, comment="", extra=extra)


@dataclass
class FakeSlurm:
    nodes_: dict[str, Node]
    drains: list[tuple[str, str]] = field(default_factory=list)
    reserved: list[str] | None = None
    jobs_: list[Job] = field(default_factory=list)
    shrunk: list[tuple[str, list[str]]] = field(default_factory=list)

    def jobs(self) -> list[Job]:
        return self.jobs_

    def shrink(self, job: str, nodes: list[str]) -> None:
        self.shrunk.append((job, nodes))

    def nodes(self) -> list[Node]:
        return list(self.nodes_.values())

    def drain(self, name: str, reason: str) -> None:
        self.drains.append((name, reason))
        self.nodes_[name] = replace(self.nodes_[name], flags=("DRAIN",), reason=reason)

    def set_reservation(self, name: str, nodes: list[str]) -> None:
        self.reserved = sorted(nodes)

    expanded: list[tuple[str, str, str | None]] = field(default_factory=list)
    refuse_expand: str | None = None
    started: list[dict] = field(default_factory=list)
    step_exits: tuple[int, bytes] | None = None  # a step that ends at once: its status and what it printed

    def expand(self, job: str, node_: str, reservation: str | None) -> None:
        if self.refuse_expand:
            raise SlurmError(self.refuse_expand)
        self.expanded.append((job, node_, reservation))
        self.jobs_ = [replace(j, nodes=(*j.nodes, node_)) if j.id == job else j for j in self.jobs_]

    def steps(self, job: str) -> list[str]:
        return [x["name"] for x in self.started if x["job"] == job]

    def start_step(self, job, node_, name, cmd, env, out):  # noqa: ANN001, ANN201
        self.started.append({"job": job, "node": node_, "name": name, "cmd": cmd, "env": env})
        if self.step_exits:
            out.write(self.step_exits[1])
        return FakeStep(self.step_exits[0] if self.step_exits else None)


@dataclass
class FakeStep:
    code: int | None

    def poll(self) -> int | None:
        return self.code

    @property
    def returncode(self) -> int | None:
        return self.code

    def kill(self) -> None:
        self.code = -9


@dataclass
class FakeCoordinator:
    hosts_: list[dict]
    workers: list[dict]
    ops_: dict[str, dict] = field(default_factory=dict)
    refuse: str | None = None
    evacuations: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    past_commit: bool = False
    signalled: list[tuple[str, int]] = field(default_factory=list)

    def hosts(self) -> list[dict]:
        return self.hosts_

    def jobs(self) -> list[dict]:
        return [{"job": "j", "workers": self.workers}]

    def ops(self, node=None, done=None, before=None, limit=None) -> list[dict]:  # noqa: ANN001
        return [o for o in self.ops_.values() if o["metadata"]["node"] == node and (done is None or o["done"] == done)]

    def op(self, op_id: str) -> dict:
        return self.ops_[op_id]

    def evacuate(self, host, to=None, idempotency_key=None, reason=None, **_kw) -> dict:  # noqa: ANN001
        if self.refuse:
            raise FailedPrecondition(self.refuse, action="add a spare")
        self.evacuations.append((host, idempotency_key, reason))
        op = {"name": f"operations/{len(self.ops_) + 1}", "done": False,
              "metadata": {"node": host, "phase": "precopy", "destination": "spare-1"}}
        self.ops_[op["name"]] = op
        return op

    def signal_job(self, job: str, sig: int) -> dict:
        self.signalled.append((job, sig))
        return {"job": job, "workers": []}

    def cancel(self, op_id: str) -> dict:
        if self.past_commit:
            raise Conflict("past its commit point", code="past_commit_point")
        self.cancelled.append(op_id)
        return self.ops_[op_id]


def world(**nodes: Node) -> tuple[FakeSlurm, FakeCoordinator, Watcher]:
    s = FakeSlurm({"a": node("a"), "b": node("b"), "spare1": node("spare1"), **nodes})
    c = FakeCoordinator(
        hosts_=[{"name": "host-a", "role": "active", "slurm_node": "a", "url": "http://a:7070"},
                {"name": "host-b", "role": "active", "slurm_node": "b", "url": "http://b:7070"},
                {"name": "spare-1", "role": "spare", "slurm_node": "spare1", "url": "http://spare:7070",
                 "socket": "/run/pitstop/agent.sock"}],
        workers=[{"id": "j.0", "host": "host-a", "state": "running"},
                 {"id": "j.1", "host": "host-b", "state": "running"}])
    return s, c, Watcher(s, c)


def note(s: FakeSlurm, name: str) -> str | None:
    return split_reason(s.nodes_[name].reason)[1]


def test_a_drain_moves_the_nodes_host_and_the_reason_follows_the_move():
    s, c, w = world(b=node("b", True, "maintenance", at=17))
    w.step()
    assert c.evacuations == [("host-b", "slurm-watch-b-17", "Slurm drain of b: maintenance")]
    assert note(s, "b") == "moving its ranks (operations/1, phase precopy)"
    assert s.nodes_["b"].reason.startswith("maintenance" + OURS)  # the operator's own reason first
    w.step()
    assert len(c.evacuations) == 1 and len(s.drains) == 1  # nothing new to say: nothing written
    c.ops_["operations/1"]["metadata"]["phase"] = "restore"
    w.step()
    assert note(s, "b") == "moving its ranks (operations/1, phase restore)"
    c.ops_["operations/1"].update(done=True)
    c.ops_["operations/1"]["metadata"].update(result="succeeded", downtime_s=0.612)
    w.step()
    assert note(s, "b") == "moved its ranks to spare-1 (operations/1, 0.61 s pause)"
    w.step()
    assert len(c.evacuations) == 1  # the same drain is not acted on twice, though its reason changed


def test_a_move_that_fails_or_is_refused_says_why_and_the_ranks_stay():
    s, c, w = world(b=node("b", True, "maintenance"))
    c.refuse = "no spare is available"
    w.step()
    assert note(s, "b") == "cannot move its ranks: no spare is available; they run here still"
    s2, c2, w2 = world(b=node("b", True, "maintenance"))
    w2.step()
    c2.ops_["operations/1"].update(done=True, error={"message": "the spare lacks /data/x"})
    c2.ops_["operations/1"]["metadata"].update(result="failed")
    w2.step()
    assert note(s2, "b") == "could not move its ranks (operations/1): the spare lacks /data/x; they run here still"


def test_drains_pitstop_cannot_or_need_not_act_on():
    s, c, w = world(b=node("b", True, "maintenance"))
    c.workers = [x for x in c.workers if x["host"] != "host-b"]
    w.step()
    assert c.evacuations == [] and note(s, "b") == "no ranks of pitstop jobs run on host-b; nothing to move"
    s, c, w = world(z=node("z", True, "maintenance"))
    w.step()
    assert c.evacuations == [] and "no pitstop agent is Slurm node z" in note(s, "z")
    s, c, w = world(b=node("b", True, "kernel panic"))
    w.reason_prefix = "maint"
    w.step()
    assert c.evacuations == [] and s.drains == []  # not the operator's kind of drain: left alone


def test_a_node_names_its_host_in_extra_before_any_report():
    s, c, w = world(b=node("b", True, "maintenance", extra="rack=7 pitstop_host=host-a"))
    w.step()
    assert c.evacuations[0][0] == "host-a"


def test_an_undrain_during_the_move_cancels_it_or_lets_it_finish_past_the_commit_point():
    s, c, w = world(b=node("b", True, "maintenance"))
    w.step()
    s.nodes_["b"] = node("b")  # `scontrol update nodename=b state=resume`
    w.step()
    assert c.cancelled == ["operations/1"] and w.moves == {}
    s, c, w = world(b=node("b", True, "maintenance"))
    c.past_commit = True
    w.step()
    s.nodes_["b"] = node("b")
    w.step()  # refused past the commit point: the move finishes; nothing raised, nothing written
    assert c.cancelled == [] and w.moves == {} and len(s.drains) == 1


def test_a_restarted_watcher_follows_the_move_its_predecessor_started():
    s, c, w = world(b=node("b", True, "maintenance"))
    w.step()
    w2 = Watcher(s, c)  # the old one is gone; Slurm's reason already carries its note
    w2.step()
    assert len(c.evacuations) == 1 and w2.moves["b"].op == "operations/1"
    c.ops_["operations/1"].update(done=True)
    c.ops_["operations/1"]["metadata"].update(result="succeeded")
    w2.step()
    assert note(s, "b") == "moved its ranks to spare-1 (operations/1)"


def test_spares_and_the_nodes_that_took_ranks_are_reserved():
    s, c, w = world(b=node("b", True, "maintenance"))
    w.step()
    assert s.reserved == ["spare1"]
    c.ops_["operations/1"].update(done=True)
    c.ops_["operations/1"]["metadata"].update(result="succeeded")
    w.step()
    c.hosts_[2]["role"] = "active"  # a spare that took ranks is active now
    c.workers[1]["host"] = "spare-1"
    w.step()
    assert s.reserved == ["spare1"]  # held while it runs the moved ranks
    c.workers.pop(1)
    w.step()
    assert s.reserved == []  # they ended: Slurm may use it again
    w = Watcher(s, c, reservation=None)
    s.reserved = None
    w.step()
    assert s.reserved is None


def test_a_degraded_host_is_drained_in_slurm_once_and_not_moved_twice():
    s, c, w = world()
    c.hosts_[0]["health"] = {"degraded": True, "reasons": ["GPU 0: 12 uncorrectable ECC errors"]}
    w.step()
    assert s.drains == [("a", "pitstop health: GPU 0: 12 uncorrectable ECC errors")]
    w.step()
    assert len(s.drains) == 1 and c.evacuations == []  # the coordinator's policy moves it, not us


def test_released_nodes_leave_the_allocations_of_the_jobs_whose_ranks_moved():
    s, c, w = world(b=node("b", True, "maintenance"))
    w.release_nodes = True
    c.workers[1]["slurm_job"] = "41"
    s.jobs_ = [Job("41", "RUNNING", ("a", "b"), "a"), Job("7", "RUNNING", ("b",), "b")]  # 7: not pitstop's
    w.step()
    c.ops_["operations/1"].update(done=True)
    c.ops_["operations/1"]["metadata"].update(result="succeeded", workers={"j.1": {}})
    c.workers[1]["host"] = "spare-1"
    w.step()
    assert s.shrunk == [("41", ["a"])]
    assert note(s, "b") == "moved its ranks to spare-1 (operations/1); freed from job 41; spare1 added to job 41"
    # a job whose batch host is the node keeps it, and the reason says so
    s, c, w = world(b=node("b", True, "maintenance"))
    w.release_nodes = True
    c.workers[1]["slurm_job"] = "42"
    s.jobs_ = [Job("42", "RUNNING", ("b", "a"), "b")]
    w.step()
    c.ops_["operations/1"].update(done=True)
    c.ops_["operations/1"]["metadata"].update(result="succeeded", workers={"j.1": {}})
    c.workers[1]["host"] = "spare-1"
    w.step()
    assert s.shrunk == [] and "job 42 keeps it (its batch host cannot leave it)" in note(s, "b")


def test_a_slurm_job_that_ends_ends_its_moved_ranks_once():
    s, c, w = world()
    for x in c.workers:
        x["slurm_job"] = "43"
    s.jobs_ = [Job("43", "RUNNING", ("a", "b"), "a")]
    w.step()
    assert c.signalled == []
    s.jobs_ = [Job("43", "CANCELLED", ("a", "b"), "a")]  # scancel
    w.step()
    w.step()
    assert c.signalled == [("j", signal.SIGKILL)]
    # a job never seen running is not taken for one that ended (a watcher started after it)
    s, c, w = world()
    c.workers[0]["slurm_job"] = "44"
    w.step()
    assert c.signalled == []


def test_a_rank_naming_another_users_slurm_job_never_gets_its_job_ended():
    """The audit's H2: uid 1001 registered a process of its own into root's job (run outside Slurm)
    naming a Slurm job of its choosing; when that Slurm job ended, the watcher SIGKILLed root's job.
    A claim counts only from root or from the Slurm job's own user."""
    s, c, w = world()
    c.workers[0].update(owner_uid=0)                      # root's rank, not under Slurm
    c.workers[1].update(slurm_job="77", owner_uid=1001)  # the intruder's claim: a Slurm job of uid 2002
    s.jobs_ = [Job("77", "RUNNING", ("b",), "b", user_id=2002)]
    w.step()
    s.jobs_ = [Job("77", "COMPLETED", ("b",), "b", user_id=2002)]
    w.step()
    assert c.signalled == [], "another user's Slurm job ending ends nothing"
    # the same ranks, the claim from the Slurm job's own user: it holds
    s, c, w = world()
    c.workers[1].update(slurm_job="77", owner_uid=2002)
    s.jobs_ = [Job("77", "RUNNING", ("b",), "b", user_id=2002)]
    w.step()
    s.jobs_ = [Job("77", "COMPLETED", ("b",), "b", user_id=2002)]
    w.step()
    assert c.signalled == [("j", signal.SIGKILL)]


def _moved(s: FakeSlurm, c: FakeCoordinator, w: Watcher, slurm_job: str = "41") -> None:
    c.workers[1]["slurm_job"] = slurm_job
    s.jobs_ = [Job(slurm_job, "RUNNING", ("a", "b"), "a")]
    w.step()
    c.ops_["operations/1"].update(done=True)
    c.ops_["operations/1"]["metadata"].update(result="succeeded", workers={"j.1": {}})
    w.step()


def test_a_spare_that_took_ranks_joins_their_slurm_job_with_a_step_holding_each(monkeypatch):
    monkeypatch.setenv("PITSTOP_TOKEN", "operator-secret")
    s, c, w = world(b=node("b", True, "maintenance"))
    _moved(s, c, w)
    assert s.expanded == [("41", "spare1", "pitstop_spares")]  # from the spares' reservation
    (st,) = s.started
    assert (st["job"], st["node"], st["name"]) == ("41", "spare1", "pitstop-hold-j.1")
    assert st["cmd"][-5:] == ["hold", "j.1", "--agent", "unix:/run/pitstop/agent.sock", "--no-output"]
    assert "PITSTOP_TOKEN" not in st["env"]  # the step runs as the job's user: no operator credential
    assert note(s, "b") == "moved its ranks to spare-1 (operations/1); spare1 added to job 41"
    w.step()
    assert len(s.started) == 1 and len(s.expanded) == 1  # once


def test_a_spare_slurm_cannot_add_stays_held_and_the_reason_says_why():
    s, c, w = world(b=node("b", True, "maintenance"))
    s.refuse_expand = "Job update not available right now, the DB index is being set"
    _moved(s, c, w)
    assert s.started == []
    assert note(s, "b") == ("moved its ranks to spare-1 (operations/1); spare1 not added to job 41 (Job update "
                            "not available right now, the DB index is being set); held in reservation pitstop_spares")
    assert s.reserved == ["spare1"]


def test_a_hold_step_that_ends_at_once_is_said_in_the_reason():
    s, c, w = world(b=node("b", True, "maintenance"))
    s.step_exits = (125, b"pitstop hold: worker j.1 does not run on this host (moved)\n")
    _moved(s, c, w)
    assert note(s, "b").endswith("spare1 added to job 41, but no step holds j.1: its step exited 125: "
                                 "pitstop hold: worker j.1 does not run on this host (moved)")


def test_no_join_without_a_slurm_job_or_when_turned_off():
    s, c, w = world(b=node("b", True, "maintenance"))
    w.step()
    c.ops_["operations/1"].update(done=True)
    c.ops_["operations/1"]["metadata"].update(result="succeeded", workers={"j.1": {}})
    w.step()  # the rank was not started by Slurm
    assert s.expanded == [] and note(s, "b") == "moved its ranks to spare-1 (operations/1)"
    s, c, w = world(b=node("b", True, "maintenance"))
    w.join_spares = False
    _moved(s, c, w)
    assert s.expanded == [] and s.started == []

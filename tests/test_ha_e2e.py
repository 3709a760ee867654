"""Two coordinators on a real PostgreSQL (tests/postgres.py), real agents, the real CLI client: one
coordinator leads from the start, the other serves reads and names the leader; clients given both
URLs find the leader; the agents refuse an older term; the leader killed, the standby takes over
within seconds and the agents follow it, none of them taken for silent; the killed one started
again stands by; a leader that stops hands the lease over at once; a new database is moved above
the terms the agents have seen."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from pitstop.errors import PitstopError
from pitstop.wire.agent_client import AgentClient
from pitstop.wire.coordinator_client import CoordinatorClient

from .helpers import until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


class FixedTerm:
    """A coordinator's fence stuck at one term (what a deposed leader's calls carry)."""

    def __init__(self, term: int) -> None:
        self.term = term
        self.refused: list[int] = []

    def current(self) -> int:
        return self.term

    def stale(self, seen: int) -> None:
        self.refused.append(seen)


def _view(url: str) -> dict:
    return httpx.get(url + "/v1/leader", timeout=5).json()


def _hosts(url: str, token: str) -> dict[str, dict]:
    r = httpx.get(url + "/v1/hosts", headers={"Authorization": f"Bearer {token}"}, timeout=5)
    r.raise_for_status()
    return {h["name"]: h for h in r.json()}


def _agent_term(cluster, name: str) -> int:  # noqa: ANN001
    return cluster.agents[name].client().info()["coordinator_term"]["term"]


def test_one_leader_standby_reads_clients_follow_and_the_standby_takes_over(cluster, pg_url):
    first, second = cluster.start_coordinators([pg_url, pg_url])  # started at once
    leader = until(cluster.leader, timeout=20, what="one coordinator leads")
    standby = second if leader is first else first
    assert _view(standby.url)["role"] == "standby" and _view(standby.url)["leader"] == leader.url
    term = _view(leader.url)["term"]
    with cluster.starting():
        for name in ("host-a", "spare-1"):
            cluster.start_agent(name, spare=name.startswith("spare"))
    tok = cluster.operator_token
    # the agents report to the leader; the standby reads the same records
    until(lambda: _hosts(standby.url, tok).keys() == {"host-a", "spare-1"}, timeout=20, what="hosts on the standby")
    until(lambda: all(_agent_term(cluster, n) == term for n in ("host-a", "spare-1")), timeout=20,
          what="the agents know the term")
    # a client given both URLs, the standby's first, sends its write to the leader
    cc = CoordinatorClient(f"{standby.url},{leader.url}", tok)
    cc.cordon("spare-1", reason="ha test")
    assert _hosts(standby.url, tok)["spare-1"]["cordoned"]["reason"] == "ha test"
    cc.uncordon("spare-1")
    # a plain client at the standby is told where the leader is
    r = httpx.post(f"{standby.url}/v1/hosts/spare-1:cordon", json={}, headers={"Authorization": f"Bearer {tok}"})
    assert r.status_code == 503 and r.json()["error"]["details"]["leader"] == leader.url, r.text
    # a call of an older term is refused by every agent; a current one passes
    old = FixedTerm(term - 1)
    with AgentClient(cluster.agents["host-a"].url, cluster.token, fence=old) as a:
        with pytest.raises(PitstopError) as e:
            a.workers()
    assert e.value.code == "stale_term" and e.value.http_status == 409 and old.refused == [term], e.value
    with AgentClient(cluster.agents["host-a"].url, cluster.token, fence=FixedTerm(term)) as a:
        assert a.workers() == []

    # the leader dies outright: the standby takes over within a few seconds
    t0 = time.monotonic()
    os.killpg(leader.proc.pid, signal.SIGKILL)
    leader.proc.wait(10)
    until(lambda: cluster.leader() is standby, timeout=15, what="the standby takes over")
    took = time.monotonic() - t0
    assert took < 3 * 3.0, took  # the lease (3 s) and a standby's look; in practice about 3 s
    assert _view(standby.url)["term"] == term + 1
    # every agent follows it and knows the new term; none was taken for silent meanwhile
    until(lambda: all(_agent_term(cluster, n) == term + 1 for n in ("host-a", "spare-1")), timeout=20,
          what="the agents know the new term")
    until(lambda: all(h["age_s"] < 2.5 for h in _hosts(standby.url, tok).values()), timeout=20,
          what="the agents report to the new leader")
    assert not any(h["silent"] for h in _hosts(standby.url, tok).values())
    # the dead leader's term is refused now
    with AgentClient(cluster.agents["spare-1"].url, cluster.token, fence=FixedTerm(term)) as a:
        with pytest.raises(PitstopError, match="stale|term"):
            a.info()
    # `pitstop doctor` says which leads, since when, and what the other is
    from pitstop.doctor import coordinators

    check = coordinators(cluster.coordinator_url)
    assert check.ok and f"{standby.url}: leads, term {term + 1}, since " in check.detail, check
    assert f"{leader.url}: unreachable" in check.detail, check
    # the client that had found the dead leader finds the new one
    cc.cordon("spare-1", reason="after the failover")
    assert _hosts(standby.url, tok)["spare-1"]["cordoned"]["reason"] == "after the failover"
    cc.uncordon("spare-1")
    cc.close()

    # the killed one, started again, stands by
    again = cluster.restart_coordinator(leader)
    until(lambda: _view(again.url)["role"] == "standby", timeout=20, what="the old leader back as a standby")
    assert _view(again.url)["leader"] == standby.url
    # a leader that stops gives the lease up: the standby takes over without waiting for it to expire
    t0 = time.monotonic()
    os.killpg(standby.proc.pid, signal.SIGTERM)
    standby.proc.wait(30)
    until(lambda: cluster.leader() is again, timeout=15, what="the lease handed over")
    assert time.monotonic() - t0 < 2.5, time.monotonic() - t0
    assert _view(again.url)["term"] == term + 2


def test_a_new_database_is_moved_above_the_terms_the_agents_have_seen(cluster, postgres, pg_url):
    first = cluster.start_coordinators([pg_url])[0]
    cluster.start_agent("host-a")
    until(lambda: _agent_term(cluster, "host-a") == 1, timeout=20, what="the agent knows term 1")
    # three more terms on that database: the same coordinator started again each time
    for _ in range(3):
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        first = cluster.restart_coordinator(first)
    until(lambda: _agent_term(cluster, "host-a") == 4, timeout=30, what="the agent knows term 4")
    # the coordinator is started on a new, empty database (the old one lost): its term would be 1
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait(10)
    fresh = postgres.create_database()
    try:
        first = cluster.restart_coordinator(first, db=fresh)
        until(lambda: _view(first.url)["term"] == 5, timeout=30, what="the lease moved above the agent's term")
        until(lambda: _agent_term(cluster, "host-a") == 5, timeout=30, what="the agent takes term 5")
        with AgentClient(cluster.agents["host-a"].url, cluster.token, fence=FixedTerm(5)) as a:
            assert a.workers() == []  # the new coordinator's calls pass
    finally:
        for c in cluster.coordinators:
            if c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGTERM)
                c.proc.wait(30)
        postgres.drop_database(fresh)

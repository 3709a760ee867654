"""One coordinator leads, through the lease in the database (coordinator/leadership.py), on SQLite and
on a real PostgreSQL: a standby takes over when the leader stops renewing, with a higher term; a
leader whose renewals fail stops acting at its own deadline (its writes and its agent calls are
refused from that moment); one that stops gives the lease up at once; an agent's higher term moves
the lease above it only while the lease is still this coordinator's.  And what a standby answers
(coordinator/standby.py): reads, and the leader's URL for the rest."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from pitstop.coordinator.api import build
from pitstop.coordinator.database import open_store
from pitstop.coordinator.leadership import Leadership
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.store import NotLeader, StoreUnavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
TTL_S = 1.0


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):  # noqa: ANN001, ANN201
    if request.param == "sqlite":
        return str(tmp_path / "c.db")
    return request.getfixturevalue("pg_url")


class Member:
    """One coordinator's stores and lease, recording what it was told."""

    def __init__(self, url: str, me: str, ttl_s: float = TTL_S, exclusive: bool = False) -> None:
        self.records, self.lease_store = open_store(url), open_store(url)
        self.led: list[tuple[int, float]] = []
        self.lost: list[str] = []
        self.lead = Leadership(self.records, self.lease_store, me, ttl_s, exclusive=exclusive,
                               on_lead=lambda t, g: self.led.append((t, g)), on_lose=self.lost.append)

    def close(self) -> None:
        self.lead.stop(release=False)
        self.records.close()
        self.lease_store.close()


def _until(cond, timeout: float, what: str):  # noqa: ANN001, ANN202
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_a_standby_takes_over_when_the_leader_stops_renewing(url):
    a, b = Member(url, "http://a:7000"), Member(url, "http://b:7000")
    try:
        assert a.lead.try_acquire() and not b.lead.try_acquire()
        a.lead.start()
        b.lead.start()
        assert a.lead.current() == 1 and a.records.fence_term == 1
        a.records.heartbeat({"name": "h", "url": "http://h:7070", "workers": []})  # the leader writes
        time.sleep(2 * TTL_S)  # renewed meanwhile: nothing changes
        assert a.lead.leading() and not b.lead.leading() and b.led == []
        assert b.lead.view() | {"since": 0} == {"leader": "http://a:7000", "term": 1, "since": 0,
                                                "this": "http://b:7000", "role": "standby", "lease_s": TTL_S,
                                                "term_changes": 0}
        a.lead._stop.set()  # the leader dies: its renewals stop, its lease stays in the database
        t0 = time.monotonic()
        term, gap = _until(lambda: b.led and b.led[0], 5 * TTL_S, "b takes over")[:2]
        took = time.monotonic() - t0
        assert term == 2 and b.lead.current() == 2 and b.records.fence_term == 2
        assert took <= TTL_S + 1.0, took  # the lease's expiry, and a standby's next look
        assert 0 < gap < TTL_S + 2.0, gap  # no coordinator led from a's last renewal until b took the lease
        with pytest.raises(NotLeader):
            a.records.create_op("op-1", "h", None, {}, None)  # a's term is over in the database
        b.records.create_op("op-2", "h", None, {}, None)
    finally:
        a.close()
        b.close()


def test_a_leader_that_cannot_renew_stops_acting_at_its_own_deadline(url, monkeypatch):
    a, b = Member(url, "http://a:7000"), Member(url, "http://b:7000")
    try:
        assert a.lead.try_acquire()
        a.lead.start()

        def cut_off(*args: object, **kw: object) -> None:
            raise StoreUnavailable("the database is out of reach")

        monkeypatch.setattr(a.lease_store, "renew_lease", cut_off)  # a partition between a and the database
        t0 = time.monotonic()
        why = _until(lambda: a.lost and a.lost[0], 3 * TTL_S, "a steps down")
        assert time.monotonic() - t0 <= TTL_S + 0.2 and "not renewed within" in why
        assert not a.lead.leading() and a.records.fence_term is None
        with pytest.raises(NotLeader):
            a.lead.current()  # no agent call passes
        with pytest.raises(NotLeader):
            a.records.set_snapshot_policy("j", 10.0)  # no write either
        assert a.lead.view()["role"] == "stepping down"
        # it never leads again in this process (server.py starts it anew, as a standby)
        assert not a.lead.try_acquire()
        # its lease expires in the database's clock a little after a stopped, never before
        _until(b.lead.try_acquire, 2 * TTL_S, "b takes the expired lease")
        assert b.lead.term == 2
    finally:
        a.close()
        b.close()


def test_on_sqlite_a_database_that_refuses_writes_does_not_end_the_lead(tmp_path, monkeypatch):
    """One coordinator on one host's file: a full disk must not stop it undoing on the agents what it
    can no longer record (driver.py); only another coordinator taking the lease ends its lead."""
    db = str(tmp_path / "c.db")
    a = Member(db, "http://a:7000", exclusive=True)
    try:
        assert a.lead.try_acquire()
        a.lead.start()

        def full(*args: object, **kw: object) -> None:
            raise StoreUnavailable("database or disk is full")

        monkeypatch.setattr(a.lease_store, "renew_lease", full)
        time.sleep(3 * TTL_S)
        assert a.lead.leading() and a.lead.current() == 1 and not a.lost
        monkeypatch.undo()
        other = Member(db, "http://b:7000")
        try:
            _until(other.lead.try_acquire, 3 * TTL_S, "a second coordinator on the file takes the expired lease")
            _until(lambda: a.lost, 3 * TTL_S, "the first sees its term is over")
            assert not a.lead.leading()
        finally:
            other.close()
    finally:
        a.close()


def test_a_coordinator_that_stops_gives_the_lease_up_at_once(url):
    a, b = Member(url, "http://a:7000", ttl_s=30.0), Member(url, "http://b:7000", ttl_s=30.0)
    try:
        assert a.lead.try_acquire()
        a.lead.start()
        a.lead.stop(release=True)
        assert b.lead.try_acquire() and b.lead.term == 2  # not 30 s later
    finally:
        a.close()
        b.close()


def test_the_same_coordinator_started_again_takes_its_lease_at_once(url):
    a = Member(url, "http://a:7000", ttl_s=30.0)
    a.lead.try_acquire()
    a.close()  # killed: its lease stays, for 30 s
    again = Member(url, "http://a:7000", ttl_s=30.0)
    other = Member(url, "http://b:7000", ttl_s=30.0)
    try:
        assert not other.lead.try_acquire()
        assert again.lead.try_acquire() and again.lead.term == 2
    finally:
        again.close()
        other.close()


def test_an_agents_higher_term_moves_the_lease_only_while_it_is_ours(url):
    a, b = Member(url, "http://a:7000"), Member(url, "http://b:7000")
    try:
        assert a.lead.try_acquire()
        a.lead.raise_above(41)  # the database was replaced: agents have seen term 41
        assert a.lead.term == 42 and a.records.fence_term == 42 and a.lease_store.lease()["term"] == 42
        a.lead.raise_above(42)  # an agent that has seen this very term: nothing to do
        assert a.lead.term == 42 and a.lease_store.lease()["term"] == 42
        a.records.create_op("op-1", "h", None, {}, None)  # its writes pass with the new term
        time.sleep(TTL_S + 0.2)  # a's lease expires (no renewals started)...
        assert b.lead.try_acquire() and b.lead.term == 43  # ...and b takes it
        a.lead.raise_above(43)  # an agent refused a's call: b leads now
        assert a.lost and "no longer this coordinator's" in a.lost[0]
    finally:
        a.close()
        b.close()


def test_coordinators_started_at_once_elect_one_leader(url):
    members = [Member(url, f"http://c{i}:7000", ttl_s=10.0) for i in range(3)]
    go = threading.Barrier(len(members))
    got: dict[int, bool] = {}

    def start(i: int) -> None:
        go.wait()
        got[i] = members[i].lead.try_acquire()

    threads = [threading.Thread(target=start, args=(i,)) for i in range(len(members))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(got.values()) == [False, False, True], got
    finally:
        for m in members:
            m.close()


def test_a_standby_serves_reads_and_names_the_leader_for_the_rest(tmp_path):
    db = str(tmp_path / "c.db")
    leader, standby = Member(db, "http://a:7000"), Member(db, "http://b:7000")
    try:
        assert leader.lead.try_acquire() and not standby.lead.try_acquire()
        leader.records.heartbeat({"name": "h", "url": "http://h:7070", "workers": []})
        s = CoordinatorSettings(db=db, insecure=True)
        app, _ = build(s, standby.records, standby.lead)
        with TestClient(app) as http:
            assert [h["name"] for h in http.get("/v1/hosts").json()] == ["h"]  # the leader's records
            assert http.get("/v1/leader").json()["role"] == "standby"
            assert http.get("/healthz").json() == {"ok": True, "role": "standby"}
            for method, path in (("POST", "/v1/hosts/h:cordon"), ("POST", "/v1/agents:beat"),
                                 ("POST", "/v1/agents:heartbeat"), ("GET", "/v1/workers/j.0/output"),
                                 ("DELETE", "/v1/hosts/h")):
                r = http.request(method, path, json={"name": "h", "generation": "g"})
                err = r.json()["error"]
                assert r.status_code == 503 and err["code"] == "not_leader", (path, r.text)
                assert err["details"]["leader"] == "http://a:7000" and r.headers["x-pitstop-leader"] == "http://a:7000"
            assert standby.records.host("h").cordoned is None  # nothing was done
        app, _ = build(s, leader.records, leader.lead)
        with TestClient(app) as http:
            assert http.post("/v1/hosts/h:cordon", json={}).status_code == 200
            assert http.get("/v1/leader").json()["role"] == "leader"
    finally:
        leader.close()
        standby.close()

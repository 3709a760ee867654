"""Spare selection and refusals, on a real SQLite store fed with heartbeats (no agents needed)."""

from __future__ import annotations

import time

import pytest

from pitstop.coordinator.planner import plan
from pitstop.coordinator.sqlitestore import Store
from pitstop.errors import Conflict, FailedPrecondition, InvalidRequest, NotFound

H100 = {"gpu_model": "NVIDIA H100 80GB HBM3", "gpu_count": 8}
H200 = {"gpu_model": "NVIDIA H200", "gpu_count": 8}


@pytest.fixture
def store(tmp_path):
    return Store(tmp_path / "c.db")


def beat(store: Store, name: str, spare: bool = False, workers=(), **info) -> None:
    store.heartbeat({"name": name, "url": f"http://{name}:7070", "spare": spare,
                     "workers": [{"id": w, "job": w.split(".")[0], "rank": int(w.split(".")[1]), "state": "running"}
                                 for w in workers], **info})


def test_picks_a_matching_spare_and_names_the_peers(store):
    beat(store, "a", workers=["j.0", "j.1"], **H100)
    beat(store, "b", workers=["j.2"], **H100)
    beat(store, "s1", spare=True, **H200)
    beat(store, "s2", spare=True, **H100)
    p = plan(store, "a", None, {}, 5.0)
    assert p.dest.name == "s2" and [w.id for w in p.leaving] == ["j.0", "j.1"]
    assert [w.id for w in p.peers] == ["j.2"] and p.jobs == ["j"]


@pytest.mark.parametrize("spare_info,why", [
    (H200, "GPU model NVIDIA H200 differs"),
    ({"gpu_model": H100["gpu_model"], "gpu_count": 4}, "4 GPUs, a has 8"),
    ({"gpu_model": None, "gpu_count": 0}, "GPU model none differs"),
])
def test_gpu_mismatch_refused_with_the_reason(store, spare_info, why):
    beat(store, "a", workers=["j.0"], **H100)
    beat(store, "s1", spare=True, **spare_info)
    with pytest.raises(FailedPrecondition) as e:
        plan(store, "a", None, {}, 5.0)
    assert e.value.code == "no_compatible_spare" and why in e.value.message and "s1" in e.value.message


def test_cpu_workers_go_to_any_spare(store):
    beat(store, "a", workers=["j.0"], gpu_model=None, gpu_count=0)
    beat(store, "s1", spare=True, **H200)
    assert plan(store, "a", None, {}, 5.0).dest.name == "s1"


def test_busy_silent_and_degraded_spares_are_skipped_with_reasons(store):
    beat(store, "a", workers=["j.0"])
    beat(store, "busy", spare=True)
    beat(store, "sick", spare=True, health={"degraded": True, "reasons": ["ECC errors 12 > 10"]})
    beat(store, "silent", spare=True)
    store.db.execute("UPDATE hosts SET last_seen=? WHERE name='silent'", (time.time() - 60,))
    store.live.forget("silent")  # liveness lives in memory first (coordinator/liveness.py)
    with pytest.raises(FailedPrecondition) as e:
        plan(store, "a", None, {"busy": "op-1"}, 5.0)
    msg = e.value.message
    assert "busy: busy with operation op-1" in msg and "sick: degraded: ECC errors 12 > 10" in msg
    assert "silent: no heartbeat for 60 s" in msg


def test_refusals(store):
    beat(store, "a", workers=["j.0"])
    beat(store, "empty")
    beat(store, "s1", spare=True)
    with pytest.raises(NotFound):
        plan(store, "nope", None, {}, 5.0)
    with pytest.raises(NotFound):
        plan(store, "a", "nope", {}, 5.0)
    with pytest.raises(InvalidRequest):
        plan(store, "a", "a", {}, 5.0)
    with pytest.raises(Conflict) as e:
        plan(store, "a", None, {"a": "op-9"}, 5.0)
    assert "op-9" in e.value.message
    with pytest.raises(FailedPrecondition) as e:
        plan(store, "empty", None, {}, 5.0)
    assert e.value.code == "nothing_to_do"
    # an explicit destination need not be a spare, but must be usable
    assert plan(store, "a", "empty", {}, 5.0).dest.name == "empty"


def test_a_workers_host_is_whoever_reports_it_alive(store):
    beat(store, "a", workers=["j.0"])
    beat(store, "b", workers=["j.0"])           # restored on b
    beat(store, "a", workers=[])                 # a no longer reports it
    store.heartbeat({"name": "a", "url": "http://a:7070",
                     "workers": [{"id": "j.0", "job": "j", "rank": 0, "state": "moved"}]})
    assert [(w.id, w.host, w.state) for w in store.workers()] == [("j.0", "b", "running")]


def test_a_cordoned_host_is_no_destination_moves_nothing_and_comes_back(store):
    """`pitstop hosts cordon`: out of the spare pool (never chosen, nor taken when named), with its
    own workers left where they run and still evacuable; uncordon lets it back."""
    from pitstop.coordinator import lifecycle
    from pitstop.coordinator.planner import usable_spare
    from pitstop.coordinator.snapshots import buddies

    beat(store, "a", workers=["j.0"])
    beat(store, "b", workers=["k.0"])
    beat(store, "s1", spare=True)
    h = lifecycle.cordon(store, "s1", "fan noise", "an operator")
    assert h["role"] == "spare" and h["cordoned"]["reason"] == "fan noise"
    assert h["cordoned"]["requested_by"] == "an operator" and h["cordoned"]["since"] <= time.time()
    beat(store, "s1", spare=True)  # its agent's next report changes nothing of it
    store.sync_workers("s1", [])  # nor a report of its workers alone
    assert store.host("s1").cordoned["reason"] == "fan noise" and not usable_spare(store.host("s1"))
    with pytest.raises(FailedPrecondition) as e:
        plan(store, "a", None, {}, 5.0)
    assert "s1: cordoned (fan noise)" in e.value.message and "pitstop hosts uncordon s1" in e.value.action
    with pytest.raises(FailedPrecondition) as e:
        plan(store, "a", "s1", {}, 5.0)
    assert "cordoned" in e.value.message
    # a cordoned host's own workers stay, and may still leave it
    lifecycle.cordon(store, "b", "", "an operator")
    assert [w.host for w in store.workers(job="k")] == ["b"]
    assert plan(store, "b", "a", {}, 5.0).dest.name == "a"
    with pytest.raises(FailedPrecondition):
        plan(store, "a", "b", {}, 5.0)
    # replicas: a cordoned spare is no spare (here the next host by name instead)
    out, why = buddies(["a"], store.hosts(), 5.0)
    assert why["a"].startswith("the next host by name")
    # a second cordon keeps the first's time; uncordon lets it back, role unchanged
    first = store.host("s1").cordoned["since"]
    assert lifecycle.cordon(store, "s1", "fans replaced, burn-in", "x")["cordoned"]["since"] == first
    h = lifecycle.uncordon(store, "s1", {"s1": "op-3"})  # nothing moves: an operation under way is no bar
    assert h["role"] == "spare" and h["cordoned"] is None
    assert plan(store, "a", None, {}, 5.0).dest.name == "s1"
    with pytest.raises(FailedPrecondition) as e:
        lifecycle.uncordon(store, "s1", {})
    assert e.value.code == "host_in_service"
    with pytest.raises(NotFound):
        lifecycle.cordon(store, "nope", "", "x")


def test_uncordon_of_a_drained_host_also_lifts_its_cordon(store):
    from pitstop.coordinator import lifecycle

    beat(store, "a", spare=True)
    lifecycle.cordon(store, "a", "rma", "x")
    store.set_role("a", "drained")
    h = lifecycle.uncordon(store, "a", {})
    assert (h["role"], h["cordoned"]) == ("spare", None)


def test_a_role_keeps_since_when_and_why(store):
    """`pitstop hosts` says since when and why a host is out of service: the evacuation's commit
    (draining) starts it, the fill's end (drained) keeps it, the same role again changes nothing."""
    from pitstop.coordinator import lifecycle

    beat(store, "a")
    joined = store.host("a").role_since
    assert joined and store.host("a").role_why is None
    why = {"reason": "disk replacement", "requested_by": "the operator token", "operation": "operations/x"}
    store.set_role("a", "draining", why)
    h = store.host("a")
    assert h.role_why == why and h.role_since >= joined
    since = h.role_since
    time.sleep(0.01)
    store.set_role("a", "drained")
    beat(store, "a")  # a report touches neither
    assert (store.host("a").role, store.host("a").role_since, store.host("a").role_why) == \
        ("drained", since, why)
    lifecycle.uncordon(store, "a", {}, "an operator")
    h = store.host("a")
    assert h.role == "active" and h.role_since > since
    assert h.role_why == {"reason": "returned to service (uncordon)", "requested_by": "an operator"}
    back = h.role_since
    store.set_role("a", "active")  # a consumed spare, or a named destination, already active
    assert store.host("a").role_since == back

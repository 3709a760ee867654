"""One operation framework (coordinator/operations.py) drives evacuations and recoveries alike: one
watchdog look covers both kinds, one reconcile resumes both (a recovery only once the snapshot a
lost coordinator left under way is undone), a record older than its @type is an evacuation, and a
kind nobody registered is left alone.  A real SQLite store; what each kind does when driven is
recorded instead of done (their end-to-end runs: tests/test_evacuation_*.py, tests/test_recovery_e2e.py,
tests/test_store_failure.py, tests/test_recovery_watchdog.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from pitstop.coordinator.driver import Driver
from pitstop.coordinator.evacuation_run import OpRun
from pitstop.coordinator.operations import Operations
from pitstop.coordinator.recovery import Recoveries
from pitstop.coordinator.recovery_run import RecoveryRun
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.sqlitestore import Store
from pitstop.wire.evacuation import EvacuationState
from pitstop.wire.recovery_state import RecoveryState

from .helpers import plan_of

pytestmark = pytest.mark.timeout(60)


class _Snaps:
    pausing: set[str] = set()


@pytest.fixture
def world(tmp_path, monkeypatch):
    store = Store(tmp_path / "c.db")
    settings = CoordinatorSettings(db=tmp_path / "c.db", watchdog_s=30.0)  # back-offs moved by hand below
    ops = Operations(store, settings)
    driver = Driver(store, settings, operations=ops)
    recoveries = Recoveries(store, settings, _Snaps(), lambda: {}, operations=ops)  # type: ignore[arg-type]
    plan = plan_of("host-b", "spare-1", {"train.1": (1, "host-b")})
    store.create_op("op-1", "host-b", "spare-1", EvacuationState.new(plan, "test").dump(), None)
    store.create_op("recover-1", "host-c", None, RecoveryState(job="llama", node="host-c", snapshot=1).dump(), None)
    driven: list[tuple[str, str]] = []
    lock = threading.Lock()

    def note(how: str):  # noqa: ANN202
        def fn(self, *a) -> None:  # noqa: ANN001, ANN002
            with lock:
                driven.append((self.id, how))
        return fn

    for cls in (OpRun, RecoveryRun):
        monkeypatch.setattr(cls, "take_over", note("take_over"))
        monkeypatch.setattr(cls, "resume", note("resume"))
    return SimpleNamespace(store=store, ops=ops, driver=driver, recoveries=recoveries, driven=driven)


def _join(ops: Operations) -> None:
    for t in list(ops.threads.values()):
        t.join(30)
        assert not t.is_alive()


def test_one_watchdog_look_adopts_an_evacuation_and_a_recovery_nothing_drives(world):
    assert sorted(world.ops.watch()) == ["op-1", "recover-1"]
    _join(world.ops)
    assert sorted(world.driven) == [("op-1", "take_over"), ("recover-1", "take_over")]
    assert isinstance(world.ops.runs["op-1"], OpRun) and isinstance(world.ops.runs["recover-1"], RecoveryRun)
    assert all(r.crash == "no driver in this coordinator" for r in world.ops.runs.values())
    assert world.ops.watch() == [], "backing off: not taken over again at the next look"
    for r in world.ops.runs.values():
        r.next_takeover = 0.0
    assert sorted(world.ops.watch()) == ["op-1", "recover-1"]
    _join(world.ops)
    assert {r.takeovers for r in world.ops.runs.values()} == {2}


def test_reconcile_resumes_both_kinds_and_a_recovery_waits_for_the_snapshot_undo(world):
    release = threading.Event()
    undo = threading.Thread(target=release.wait, args=(30,), daemon=True)
    undo.start()
    assert sorted(world.ops.reconcile(by="a test", snapshots_undone=undo)) == ["op-1", "recover-1"]
    world.ops.threads["op-1"].join(30)
    assert world.driven == [("op-1", "resume")], "the evacuation is not held by a snapshot's undo"
    assert world.ops.threads["recover-1"].is_alive(), "the recovery waits for the snapshot's undo"
    release.set()
    _join(world.ops)
    assert sorted(world.driven) == [("op-1", "resume"), ("recover-1", "resume")]


def test_a_record_without_its_type_is_an_evacuation_and_an_unknown_kind_is_left_alone(world):
    ops = Operations(world.store, world.ops.s)  # a one-worker move's driver: evacuations only
    Driver(world.store, world.ops.s, operations=ops)
    md = world.store.op("op-1").metadata
    md.pop("@type")
    world.store.update_op("op-1", metadata=md)
    world.store.create_op("op-x", "host-d", None, {"@type": "type.example/Other"}, None)
    assert ops.kind_of(world.store.op("op-1")) == "type.pitstop.dev/EvacuateMetadata"
    assert ops.kind_of(world.store.op("recover-1")) is None and ops.kind_of(world.store.op("op-x")) is None
    assert ops.watch() == ["op-1"]
    _join(ops)
    assert world.driven == [("op-1", "take_over")]


def test_a_record_that_cannot_be_read_holds_up_no_other_operation(world):
    world.store.create_op("recover-bad", "host-d", None, {"@type": "type.pitstop.dev/RecoverMetadata"}, None)
    assert sorted(world.ops.watch()) == ["op-1", "recover-1"], "the unreadable one is passed over, said in the log"
    _join(world.ops)
    world.driven.clear()
    assert sorted(world.ops.reconcile(by="a test")) == ["op-1", "recover-1"]
    _join(world.ops)
    assert sorted(world.driven) == [("op-1", "resume"), ("recover-1", "resume")]

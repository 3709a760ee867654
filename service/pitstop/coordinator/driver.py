"""The coordinator's driver of evacuations: it starts each as a durable operation (evacuation_run.OpRun)
on a thread of its own, and is the watchdog that adopts one whose thread ended without ending it
(its rollback, or its commit, driven here), reconciles what a restarted coordinator finds in the
store, and retries a source's cleanup whenever that node's agent reports.
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from typing import Any, Callable

import structlog

from pitstop.coordinator.evacuation_run import OpRun
from pitstop.coordinator.recovery import is_recovery
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.store import BaseStore, StoreUnavailable
from pitstop.coordinator.timeouts import (
    TAKEOVER_BACKOFF_MAX_S,
)
from pitstop.errors import PitstopError
from pitstop.wire.agent_client import Fence
from pitstop.wire.evacuation import AfterMove, EvacuationState

log = structlog.get_logger("pitstop.coordinator.driver")


class Driver:
    def __init__(self, store: BaseStore, settings: CoordinatorSettings,
                 on_phase: Callable[[str, float], None] | None = None,
                 on_result: Callable[[str, int, float | None], None] | None = None,
                 on_after_move: Callable[[AfterMove], None] | None = None,
                 await_fills: bool = True, fence: Fence | None = None) -> None:
        self.store = store
        self.s = settings
        self.fence = fence  # the leader's term on every call to an agent (coordinator/leadership.py)
        # Network post-copy: the operation stays open until every fill has ended (the node must
        # stay up until then).  Off only for one-worker moves in tests (migration/move.py).
        self.await_fills = await_fills
        self._on_phase = on_phase
        self._on_result = on_result
        self.on_after_move = on_after_move
        self.threads: dict[str, threading.Thread] = {}
        self.runs: dict[str, OpRun] = {}  # operations this process drives, until their last write is in
        self._runs_lock = threading.Lock()  # an operation being started is not one to adopt (watch)
        # done operations whose node has not yet freed what the move left there (clean_source)
        self._cleanups: dict[str, set[str]] = {}
        self._cleanup_next: dict[str, float] = {}
        self._cleanup_lock = threading.Lock()

    def cleanup_pending(self, node: str, op_id: str, pending: bool) -> None:
        with self._cleanup_lock:
            ops = self._cleanups.setdefault(node, set())
            (ops.add if pending else ops.discard)(op_id)
            if not ops:
                del self._cleanups[node]

    def node_seen(self, node: str) -> None:
        """An agent reported: ask it again to free what earlier moves left on it.

        Called for every beat, on the event loop: a dictionary look-up unless something is
        pending, and then at most one retry per node every source_cleanup_retry_s."""
        if node not in self._cleanups:
            return
        now = time.monotonic()
        with self._cleanup_lock:
            ops = sorted(self._cleanups.get(node, ()))
            if not ops or now < self._cleanup_next.get(node, 0.0):
                return
            self._cleanup_next[node] = now + self.s.source_cleanup_retry_s + self.s.source_cleanup_deadline_s
        threading.Thread(target=self._retry_cleanups, args=(node, ops), daemon=True, name=f"cleanup-{node}").start()

    def _retry_cleanups(self, node: str, ops: list[str]) -> None:
        try:
            for op_id in ops:
                run = OpRun(self, op_id)
                try:
                    run.clean_source(later=True)
                except Exception as e:  # noqa: BLE001 - tried again at the next report
                    log.warning("cleanup retry failed", op=op_id, node=node, error=repr(e))
                finally:
                    run.close_clients()
        finally:
            with self._cleanup_lock:  # the next try, no sooner than the retry interval from now
                self._cleanup_next[node] = time.monotonic() + self.s.source_cleanup_retry_s

    def observe_phase(self, phase: str, seconds: float) -> None:
        if self._on_phase:
            self._on_phase(phase, seconds)

    def count(self, result: str, nbytes: int, downtime_s: float | None = None) -> None:
        if self._on_result:
            self._on_result(result, nbytes, downtime_s)

    def busy_hosts(self) -> dict[str, str]:
        out = {}
        for op in self.store.ops(running_only=True):
            out[op["node"]] = op["id"]
            if op["dest"]:
                out[op["dest"]] = op["id"]
        return out

    def start(self, plan: Any, reason: str, idem: tuple[str, str] | None, post_copy: bool | None = None,
              pre_copy: bool | None = None, requested_by: str = "") -> str:
        op_id = "op-" + uuid.uuid4().hex[:12]
        with self._runs_lock:
            self.store.create_op(op_id, plan.node["name"], plan.dest["name"],
                                 EvacuationState.new(plan, reason, post_copy, pre_copy, requested_by).dump(), idem)
            self._spawn(op_id, lambda r: r.run())
        return op_id

    def _spawn(self, op_id: str, fn: Callable[[OpRun], None], run: OpRun | None = None) -> None:
        """Drive `fn` over the operation in a thread of its own.  `run`: the one a dead thread
        left (its metadata is fresher than the database's, which may have refused writes)."""
        run = run or OpRun(self, op_id)

        def body() -> None:
            try:
                fn(run)
            except BaseException as e:  # noqa: BLE001 - the watchdog takes over (watch)
                run.crash = f"{type(e).__name__}: {e}"
                log.exception("the driver of an operation stopped; the watchdog takes over", op=op_id)
            finally:
                run.close_clients()  # a takeover opens its own

        t = threading.Thread(target=body, name=f"op-{op_id}", daemon=True)
        self.runs[op_id] = run
        self.threads[op_id] = t
        t.start()

    def watch(self) -> list[str]:
        """The coordinator's watchdog, every watchdog_s (server.py): no operation stays half
        done because the thread driving it ended.  An operation whose driver ended is taken
        over: its last write tried again if only that is missing (the rollback or the commit
        is done on the agents; the database refused the record), else its rollback (or, past
        the commit point, its commit) driven again from where the metadata says, as often as
        it takes, backing off.  An operation the database says runs and no thread of this
        process drives is adopted the same way.  The operations taken over."""
        taken = []
        with self._runs_lock:
            for op_id, run in list(self.runs.items()):
                t = self.threads.get(op_id)
                if t is not None and t.is_alive():
                    continue
                if run.journal.finished or run.write_final():
                    del self.runs[op_id]
                    self.threads.pop(op_id, None)
                elif run.journal.final is None and time.monotonic() >= run.next_takeover:
                    self._take_over(run)
                    taken.append(op_id)
            try:
                stray = [op["id"] for op in self.store.ops(running_only=True)
                         if op["id"] not in self.runs and not is_recovery(op)]
            except StoreUnavailable:
                stray = []
            for op_id in stray:  # its record says it runs, and nothing here drives it
                try:
                    run = OpRun(self, op_id)
                except StoreUnavailable:
                    continue  # read again at the next look
                run.crash = "no driver in this coordinator"
                self._take_over(run)
                taken.append(op_id)
        return taken

    def _take_over(self, run: OpRun) -> None:
        run.takeovers += 1
        run.next_takeover = time.monotonic() + min(TAKEOVER_BACKOFF_MAX_S, self.s.watchdog_s * 2 ** run.takeovers)
        log.error("watchdog: an operation's driver ended without ending it; driving its way out", op=run.id,
                  phase=run.md.phase, committed=run.md.committed, crash=run.crash,
                  takeover=run.takeovers)
        self._spawn(run.id, lambda r: r.recover(), run)

    def reconcile(self, by: str = "a restarted coordinator") -> list[str]:
        """After a restart, or a standby's takeover (coordinator/takeover.py): finish what passed its
        commit point, roll back everything else.  by: who resumes them, as each operation's
        `Resumed` condition says (its time is when the new coordinator began driving it)."""
        touched = []
        for op in self.store.ops():
            if op["done"] and op["metadata"].get("source_cleanup_pending"):
                self.cleanup_pending(op["node"], op["id"], True)
        for op in self.store.ops(running_only=True):
            if is_recovery(op):  # coordinator/recovery.py runs it again itself
                continue
            touched.append(op["id"])
            if op["metadata"].get("committed"):
                log.info("reconcile: finishing committed operation", op=op["id"])
                self._spawn(op["id"], functools.partial(_finish, by=by))
            else:
                phase = op["phase"]
                log.info("reconcile: rolling back operation", op=op["id"], phase=phase)
                restarted = PitstopError(
                    f"the coordinator restarted (or another took over) during phase {phase!r}, before the commit "
                    "point; rolled back", code="coordinator_restarted",
                    action="evacuate again if the host must still be drained")
                self._spawn(op["id"], functools.partial(_roll_back, by=by, err=restarted))
        return touched


def _finish(run: OpRun, by: str) -> None:
    _resumed(run, by, "finished past the commit point")
    run.finish_commit(PitstopError("coordinator restarted"))


def _roll_back(run: OpRun, by: str, err: PitstopError) -> None:
    _resumed(run, by, "rolled back")
    run.rollback(err)


def _resumed(run: OpRun, by: str, how: str) -> None:
    """The first write of a coordinator that resumes an operation it did not start: who, and when
    (its record's update time).  A database that refuses it delays nothing on the agents."""
    try:
        run.condition("Resumed", True, "CoordinatorChanged", f"resumed by {by}: {how}")
    except StoreUnavailable:
        pass

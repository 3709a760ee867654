"""The coordinator's driver of evacuations: it starts each as a durable operation (evacuation_run.OpRun)
through the operations' framework (operations.py: its thread, the watchdog's takeover, the
reconcile after a restart), and retries a source's cleanup whenever that node's agent reports.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Callable

import structlog

from pitstop.coordinator.evacuation_run import OpRun
from pitstop.coordinator.operations import Operations
from pitstop.coordinator.planner import Plan
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.store import BaseStore
from pitstop.wire.agent_client import Fence
from pitstop.wire.evacuation import TYPE_URL, AfterMove, EvacuationState

log = structlog.get_logger("pitstop.coordinator.driver")


class Driver:
    def __init__(self, store: BaseStore, settings: CoordinatorSettings,
                 on_phase: Callable[[str, float], None] | None = None,
                 on_result: Callable[[str, int, float | None], None] | None = None,
                 on_after_move: Callable[[AfterMove], None] | None = None,
                 await_fills: bool = True, fence: Fence | None = None,
                 operations: Operations | None = None) -> None:
        self.store = store
        self.s = settings
        self.fence = fence  # the leader's term on every call to an agent (coordinator/leadership.py)
        # Network post-copy: the operation stays open until every fill has ended (the node must
        # stay up until then).  Off only for one-worker moves in tests (migration/move.py).
        self.await_fills = await_fills
        self._on_phase = on_phase
        self._on_result = on_result
        self.on_after_move = on_after_move
        # the framework that runs, watches and reconciles every operation (operations.py); the
        # coordinator's own, shared with the recoveries, or one for this driver alone (a one-worker move)
        self.ops = operations or Operations(store, settings)
        self.ops.kind(TYPE_URL, lambda op_id: OpRun(self, op_id), default=True)
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
            out[op.node] = op.id
            if op.dest:
                out[op.dest] = op.id
        return out

    def start(self, plan: Plan, reason: str, idem: tuple[str, str] | None, post_copy: bool | None = None,
              pre_copy: bool | None = None, requested_by: str = "") -> str:
        op_id = "op-" + uuid.uuid4().hex[:12]
        self.ops.start(op_id, lambda: self.store.create_op(
            op_id, plan.node.name, plan.dest.name,
            EvacuationState.new(plan, reason, post_copy, pre_copy, requested_by).dump(), idem))
        return op_id

    def reconcile_cleanups(self) -> None:
        """After a restart, or a standby's takeover: the nodes that still hold what an earlier move
        left there are asked again at their next report (node_seen)."""
        for op in self.store.ops():
            if op.done and op.metadata.get("source_cleanup_pending"):
                self.cleanup_pending(op.node, op.id, True)

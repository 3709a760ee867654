"""What a phase's collaborator needs of the evacuation it belongs to (evacuation_run.OpRun), written once:
the pre-copies (precopies.py), the early rewire (prewire.py), the fills and the source's cleanup
after the commit (fills.py, cleanup.py) and the after-move watch (aftermove.py) each hold their own
state and report into the operation through this surface only, never through its private parts."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from pitstop.coordinator import progress
from pitstop.coordinator.cut import Cut
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.store import BaseStore
from pitstop.wire.agent_client import AgentClient, Fence
from pitstop.wire.evacuation import AfterMove, EvacuationState
from pitstop.wire.store_rows import StoredOp


class Ends(Protocol):
    def end(self) -> None: ...


class Evacuation(Protocol):
    id: str
    md: EvacuationState
    op: StoredOp  # the operation's row as last read (its response, for a later cleanup)
    lock: threading.RLock
    best_effort: bool  # past the commit point or rolling back: a refused write waits, nothing else does
    progress_before: progress.Sample | None
    progress_cut: progress.Sample | None
    rank_stopped: dict[str, float]
    rank_running: dict[str, float]

    @property
    def store_error(self) -> str | None: ...
    @property
    def prewire(self) -> Ends: ...  # the early rewire (prewire.py): ended before a rollback rewires in place

    @property
    def settings(self) -> CoordinatorSettings: ...
    @property
    def fence(self) -> Fence | None: ...
    @property
    def store(self) -> BaseStore: ...
    def url(self, host: str) -> str: ...
    def agent(self, host: str) -> AgentClient: ...
    def image_id(self, wid: str) -> str: ...
    def cut(self, moved: bool = False) -> Cut: ...
    def save(self, **kw: Any) -> None: ...
    def record(self, write: Callable[[], None]) -> None: ...
    def enter(self, phase: str) -> None: ...
    def leave(self, phase: str) -> None: ...
    def condition(self, type_: str, status: bool, reason: str, message: str = "") -> None: ...
    def check(self) -> None: ...
    def settle_job_pause(self) -> None: ...
    def record_after(self, after: AfterMove) -> None: ...


class DriverHooks(Protocol):
    """What an operation needs of the driver that runs it (driver.Driver): the store, the settings,
    the leader's term, and where it reports its phases, results and leftovers."""

    s: CoordinatorSettings
    store: BaseStore
    fence: Fence | None
    await_fills: bool  # off only for one-worker moves in tests (migration/move.py)
    on_after_move: Callable[[AfterMove], None] | None

    def cleanup_pending(self, node: str, op_id: str, pending: bool) -> None: ...
    def count(self, result: str, nbytes: int, downtime_s: float | None = None) -> None: ...
    def observe_phase(self, phase: str, seconds: float) -> None: ...

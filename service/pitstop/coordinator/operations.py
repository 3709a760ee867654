"""The coordinator's long-running operations (AIP-151), driven by one framework: an evacuation
(evacuation_run.OpRun) and a recovery (recovery_run.RecoveryRun) are each an `Operation`, and one
`Operations` runs, watches and reconciles them all.

Why one: each used to carry its own phase loop, its own saves, its own watchdog and its own
restart path, and a lesson learnt by one (a database that refuses writes must not strand the
agents' side; a driving thread that dies must not leave ranks paused) had to be learnt again by
the other.  Here each is written once:

- the record: the operation's metadata, a typed model written whole through its journal
  (journal.py): before the commit point a refused write raises and the phase is not begun;
  after it, and in a rollback, it waits and is written later; the last write is kept until the
  database takes it;
- the phases: `FORWARD`, the operation's phase table, run in order by `drive()`, then `commit()`;
  each phase is written to the record as it is entered (`enter`), timed as it is left (`leave`),
  and is a named fault point (`{fault_prefix}:{phase}`, pitstop/faults.py);
- the agents: one client per host for the whole operation (one connection pool), closed when
  its driving thread ends; a host's address as the store last gave it, so that a database that
  cannot even be read keeps no undo from the agents;
- three ways in: `run` (it was just started), `take_over` (the watchdog found its thread ended
  without ending it) and `resume` (a coordinator found it running in the store after a restart or
  a takeover of the lease).  What each means is the kind's: an evacuation rolls back (or, past its
  commit point, finishes); a recovery runs again from its start, which it may (it is idempotent).
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import structlog

from pitstop import faults
from pitstop.coordinator.journal import Journal
from pitstop.coordinator.settings import CoordinatorSettings
from pitstop.coordinator.store import BaseStore, StoreUnavailable
from pitstop.coordinator.timeouts import TAKEOVER_BACKOFF_MAX_S
from pitstop.errors import NotFound
from pitstop.wire.agent_client import AgentClient, Fence
from pitstop.wire.store_rows import StoredOp

log = structlog.get_logger("pitstop.coordinator.operations")


class Recorded(Protocol):
    """What the framework reads and writes of an operation's metadata (a wire/ record)."""

    phase: str | None
    phases: dict[str, float]

    def dump(self) -> dict[str, Any]: ...


class Operation(ABC):
    """One operation this coordinator process drives (or takes over, or resumes)."""

    # the prefix of its phases' fault points: `phase:capture`, `recovery_phase:restore`
    fault_prefix: ClassVar[str] = "phase"
    # resumed after a restart only once a snapshot the last coordinator left under way is undone
    # (a recovery: that snapshot's resume must not reach the ranks it restores)
    after_snapshots: ClassVar[bool] = False
    # its takeover reads its record from the store first (a recovery runs again from what the
    # store holds): while the store cannot be read it is not taken over, and no back-off builds up
    reads_store_to_take_over: ClassVar[bool] = False

    def __init__(self, store: BaseStore, settings: CoordinatorSettings, fence: Fence | None,
                 op: StoredOp, md: Recorded,
                 observe: Callable[[str, float], None] | None = None) -> None:
        self.store = store
        self.s = settings
        self.fence = fence  # the leader's term on every call to an agent (coordinator/leadership.py)
        self.id: str = op.id
        self.op = op  # the operation's row as read when this object was made
        self.md = md
        self.lock = threading.RLock()
        self.journal = Journal(store, self.id, lambda: self.md.dump(), self.lock)
        self._observe = observe  # a phase's seconds, to the metrics
        self._phase_t0 = time.monotonic()
        self.started = time.monotonic()
        self._clients: dict[str, AgentClient] = {}
        self._urls: dict[str, str] = {}  # host -> its agent's URL, as last read from the store
        # the watchdog's view of it (Operations.watch)
        self.crash: str | None = None  # what ended the driving thread, when something did
        self.takeovers = 0
        self.next_takeover = 0.0  # time.monotonic() before which the watchdog leaves it alone

    # -- the kind's own ---------------------------------------------------------------------
    FORWARD: ClassVar[tuple[Callable[[Any, Any], None], ...]] = ()  # the phases, in order

    @abstractmethod
    def begin(self) -> Any:
        """What every phase of one drive works with (handed to each of FORWARD and to commit)."""

    @abstractmethod
    def commit(self, ctx: Any) -> None:
        """What follows the last forward phase."""

    @abstractmethod
    def run(self) -> None:
        """Drive it from its start: `drive()`, and what a failure means for this kind."""

    @abstractmethod
    def take_over(self) -> None:
        """The thread that drove it ended without ending it: drive its way out."""

    @abstractmethod
    def resume(self, by: str) -> None:
        """A coordinator that did not start it found it running (a restart, a new leader)."""

    def drive(self) -> None:
        ctx = self.begin()
        for step in self.FORWARD:
            step(self, ctx)
        self.commit(ctx)

    # -- the record ---------------------------------------------------------------------------
    @property
    def best_effort(self) -> bool:
        """Past the commit point or rolling back: a write the database refuses waits (journal.py)."""
        return self.journal.best_effort

    @best_effort.setter
    def best_effort(self, on: bool) -> None:
        self.journal.best_effort = on

    @property
    def store_error(self) -> str | None:
        return self.journal.store_error

    def save(self, **kw: Any) -> None:
        self.journal.save(**kw)

    def record(self, write: Callable[[], None]) -> None:
        self.journal.record(write)

    def finish(self, **kw: Any) -> bool:
        return self.journal.finish(**kw)

    def write_final(self) -> bool:
        return self.journal.write_final()

    def enter(self, phase: str, leaving: str | None = None) -> None:
        """The phase, written before it begins.  leaving: the one it follows, timed in the same write."""
        with self.lock:
            now = time.monotonic()
            if leaving:
                self._timed(leaving, now - self._phase_t0)
            self.md.phase = phase
            self._phase_t0 = now
            self.save(phase=phase)
        log.info("phase", op=self.id, phase=phase)
        faults.hit(f"{self.fault_prefix}:{phase}")

    def leave(self, phase: str) -> None:
        with self.lock:
            self._timed(phase, time.monotonic() - self._phase_t0)
            self.save()

    def phase_seconds(self) -> float:
        """How long the phase it is in has lasted."""
        return time.monotonic() - self._phase_t0

    def _timed(self, phase: str, seconds: float) -> None:
        self.md.phases[phase] = round(seconds, 4)
        if self._observe:
            self._observe(phase, seconds)

    # -- the agents ---------------------------------------------------------------------------
    def agent(self, host: str) -> AgentClient:
        """The host's agent; one client (one connection pool) per host for the whole operation."""
        with self.lock:
            c = self._clients.get(host)
            if c is None:
                c = self._clients[host] = AgentClient(self.url(host), self.s.cluster_token,
                                                      timeout=self.s.step_timeout_s, fence=self.fence)
            return c

    def asking(self, host: str, timeout: float) -> AgentClient:
        """A client of its own with a shorter timeout, for one question (the caller closes it)."""
        return AgentClient(self.url(host), self.s.cluster_token, timeout=timeout, fence=self.fence)

    def url(self, host: str) -> str:
        """The host's agent, as the store knows it; else as this operation last reached it."""
        try:
            h = self.store.host(host)
        except StoreUnavailable:
            if host in self._urls:
                return self._urls[host]
            raise
        if h is None:
            raise NotFound(f"host {host} is unknown", action="it must heartbeat to the coordinator")
        self._urls[host] = h.url
        return str(h.url)

    def close_clients(self) -> None:
        """Close this operation's agent clients (a takeover, or a later retry, opens its own)."""
        with self.lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()


class Operations:
    """Every operation this coordinator process drives: one thread each, the watchdog that takes
    over one whose thread ended without ending it, and the reconcile that resumes, after a restart
    or a change of leader, what the store says runs."""

    def __init__(self, store: BaseStore, settings: CoordinatorSettings) -> None:
        self.store = store
        self.s = settings
        self._kinds: dict[str, Callable[[str], Operation]] = {}  # metadata @type -> load one by id
        self._default: str | None = None  # the kind of a record written before its @type was kept
        self.runs: dict[str, Operation] = {}  # operations this process drives, until their last write is in
        self.threads: dict[str, threading.Thread] = {}
        self._lock = threading.RLock()  # an operation being started is not one to adopt (watch)

    def kind(self, type_url: str, load: Callable[[str], Operation], default: bool = False) -> None:
        """Drive operations whose metadata is `type_url` (default: also those without an @type)."""
        self._kinds[type_url] = load
        if default:
            self._default = type_url

    def kind_of(self, op: StoredOp) -> str | None:
        """The operation's kind, where this process drives that kind (else None)."""
        t = op.metadata.get("@type") or self._default
        return t if t in self._kinds else None

    def start(self, op_id: str, create: Callable[[], None]) -> None:
        """Write a new operation (`create`) and drive it from its start."""
        with self._lock:
            create()
            self.spawn(op_id, lambda r: r.run())

    def spawn(self, op_id: str, fn: Callable[[Operation], None], run: Operation | None = None,
              after: threading.Thread | None = None) -> None:
        """Drive `fn` over the operation on a thread of its own (once `after` has ended).  run: the
        one a dead thread left (its metadata is fresher than the database's, which may have refused
        writes); else it is read from the store."""
        with self._lock:
            if run is None:
                op = self.store.op(op_id)
                assert op is not None and self.kind_of(op), op_id
                run = self._kinds[self.kind_of(op)](op_id)  # type: ignore[index]

            def body() -> None:
                try:
                    if after is not None:
                        after.join()
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
        """The watchdog, every watchdog_s (server.py): no operation stays half done because the
        thread driving it ended.  One whose last write only is missing (it is over on the agents;
        the database refused the record) has it written again; any other is taken over, as often
        as it takes, backing off.  One the store says runs and no thread of this process drives
        is adopted the same way.  The operations taken over."""
        taken = []
        with self._lock:
            try:
                running: list[StoredOp] | None = self.store.ops(running_only=True)
            except StoreUnavailable:
                running = None  # read again at the next look
            ended: set[str] = set()
            for op_id, run in list(self.runs.items()):
                t = self.threads.get(op_id)
                if t is not None and t.is_alive():
                    continue
                if run.journal.finished or run.write_final():
                    del self.runs[op_id]
                    self.threads.pop(op_id, None)
                    ended.add(op_id)  # done now, though `running` was read before its last write
                elif run.journal.final is None and time.monotonic() >= run.next_takeover \
                        and (running is not None or not run.reads_store_to_take_over):
                    self._take_over(run)
                    taken.append(op_id)
            for op in running or []:  # its record says it runs, and nothing here drives it
                if op.id in self.runs or op.id in ended or not self.kind_of(op):
                    continue
                try:
                    run = self._kinds[self.kind_of(op)](op.id)  # type: ignore[index]
                except StoreUnavailable:
                    continue  # read again at the next look
                except Exception:  # noqa: BLE001 - one record it cannot read holds up no other operation
                    log.exception("the watchdog could not load an operation the store says runs", op=op.id)
                    continue
                run.crash = "no driver in this coordinator"
                self._take_over(run)
                taken.append(op.id)
        return taken

    def _take_over(self, run: Operation) -> None:
        run.takeovers += 1
        run.next_takeover = time.monotonic() + min(TAKEOVER_BACKOFF_MAX_S, self.s.watchdog_s * 2 ** run.takeovers)
        log.error("watchdog: an operation's driver ended without ending it; driving its way out", op=run.id,
                  phase=run.md.phase, crash=run.crash, takeover=run.takeovers)
        self.spawn(run.id, lambda r: r.take_over(), run)

    def reconcile(self, by: str, snapshots_undone: threading.Thread | None = None) -> list[str]:
        """Resume every operation the store says runs (Operation.resume).  by: who resumes them, as
        their records say.  snapshots_undone: the undoing of a snapshot the last coordinator left
        under way, which the kinds with `after_snapshots` wait for."""
        touched = []
        for op in self.store.ops(running_only=True):
            kind = self.kind_of(op)
            if kind is None:
                continue
            try:
                run = self._kinds[kind](op.id)
            except Exception:  # noqa: BLE001 - one record it cannot read holds up no other operation
                log.exception("reconcile: an operation the store says runs could not be loaded; the watchdog "
                              "tries again", op=op.id)
                continue
            log.info("reconcile: resuming an operation", op=op.id, phase=op.phase, kind=kind)
            self.spawn(op.id, lambda r: r.resume(by), run,
                       after=snapshots_undone if run.after_snapshots else None)
            touched.append(op.id)
        return touched

"""An operation's writes to the store, made so that a database that refuses them never strands
the agents' side of an operation that must go on.

Before the commit point a refused write raises: a phase that cannot be recorded is not started,
and the move rolls back.  In the rollback and past the commit point (`best_effort`) a refused
write is only noted, kept, and written, in order, before the next one that passes; the
operation's metadata goes whole with every write, so that one carries it.  The last write (done,
the result) waits here until the database takes it: until then the operation reads as running,
and the watchdog (operations.Operations.watch) writes it later."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import structlog

from pitstop.coordinator.store import BaseStore, StoreUnavailable

log = structlog.get_logger("pitstop.coordinator.journal")


class Journal:
    """One operation's writes."""

    def __init__(self, store: BaseStore, op_id: str, metadata: Callable[[], dict[str, Any]],
                 lock: threading.RLock) -> None:
        self.store = store
        self.op_id = op_id
        self.metadata = metadata  # the operation's metadata as it is now: every write carries it whole
        self.lock = lock  # the operation's: a write and the change it records are one step
        self.best_effort = False  # set by the rollback and past the commit point
        self.unwritten: list[Callable[[], None]] = []  # writes refused in best-effort mode, in order
        self.store_error: str | None = None  # the last write the database refused, if any
        self.final: dict[str, Any] | None = None  # the last write (done, result), until the database takes it
        self.finished = False  # that last write is in the database: nothing more to do

    def save(self, **kw: Any) -> None:
        """Write the operation's metadata (and kw)."""
        with self.lock:
            try:
                self._write_unwritten()
                self.store.update_op(self.op_id, metadata=self.metadata(), **kw)
            except StoreUnavailable as e:
                if not self.best_effort:
                    raise
                self._refused(e)

    def record(self, write: Callable[[], None]) -> None:
        """A store write besides the operation's own (membership, roles)."""
        with self.lock:
            try:
                self._write_unwritten()
                write()
            except StoreUnavailable as e:
                if not self.best_effort:
                    raise
                self.unwritten.append(write)
                self._refused(e)

    def finish(self, **kw: Any) -> bool:
        """The operation's last write, after everything the agents had to do; whether it is written."""
        with self.lock:
            self.final = kw
        return self.write_final()

    def write_final(self) -> bool:
        with self.lock:
            if self.final is None:
                return self.finished
            try:
                self._write_unwritten()
                self.store.update_op(self.op_id, metadata=self.metadata(), **self.final)
            except StoreUnavailable as e:
                self._refused(e)
                return False
            self.final, self.finished = None, True
        if self.store_error:
            log.info("operation recorded: the database takes writes again", op=self.op_id)
        return True

    def _write_unwritten(self) -> None:
        while self.unwritten:
            self.unwritten[0]()
            self.unwritten.pop(0)

    def _refused(self, e: StoreUnavailable) -> None:
        if self.store_error != e.message:
            log.warning("the database refused a write; the operation goes on and writes it later",
                        op=self.op_id, error=e.message)
        self.store_error = e.message

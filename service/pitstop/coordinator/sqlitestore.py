"""The coordinator's records in SQLite (WAL): the embedded default, one coordinator on one host
(`make demo`, a single-host cluster).  The records themselves, and the SQL, are the store's
(coordinator/store.py); this is only the connection, its transactions, where the schema's version
is kept (PRAGMA user_version) and which of SQLite's errors mean the database cannot be used now."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from pitstop.coordinator.store import BaseStore, Row, StoreUnavailable

# What the file system or the disk did to SQLite, not a mistake in pitstop's SQL: these pass
# once an operator (or time) fixes the database's file system, so they are answered as 503.
_UNAVAILABLE = {sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED,
                sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB,
                sqlite3.SQLITE_NOMEM, sqlite3.SQLITE_PROTOCOL}


def _unavailable(e: sqlite3.Error) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in _UNAVAILABLE


class Store(BaseStore):
    """The records in SQLite (WAL): the embedded default, one coordinator on one host."""

    BUSY_TIMEOUT_MS = 5000  # two coordinators of one host on one file take turns, briefly

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.where = str(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(f"PRAGMA busy_timeout={self.BUSY_TIMEOUT_MS}")
        self._open()

    def close(self) -> None:
        """Under the lock: closing the connection while another thread runs a statement on it
        crashes the process (sqlite3 frees what that statement uses).  A thread that comes later
        (an operation's, as its coordinator stops) gets StoreUnavailable, as from a database down."""
        with self.lock:
            self._closed = True
            self.db.close()

    def _open_db(self) -> sqlite3.Connection:
        if getattr(self, "_closed", False):
            raise StoreUnavailable(f"the coordinator's database {self.path} is closed: the coordinator is stopping",
                                   action="nothing to do: a coordinator that starts again takes up what it left")
        return self.db

    def _execute(self, sql: str, args: tuple = ()) -> list[Row]:
        return self._open_db().execute(sql, args).fetchall()

    def _executemany(self, sql: str, rows: list[tuple]) -> None:
        self._open_db().executemany(sql, rows)

    def _begin(self) -> None:
        """SQLite itself rolls back a transaction that hit a full disk or an I/O error: a ROLLBACK
        sent after that fails with "cannot rollback - no transaction is active", which then hid
        the real error ("database or disk is full").  So ROLLBACK goes only to a transaction
        still open, and a failing one never replaces the error that caused it."""
        if self._open_db().in_transaction:  # one a failed ROLLBACK left open: nothing of it is ours
            self.db.execute("ROLLBACK")
        # Where coordinators share the file, a transaction's first read (the term) must not have to
        # become a write later: SQLite would answer BUSY at once instead of waiting its turn.
        self.db.execute("BEGIN IMMEDIATE" if self.fenced else "BEGIN")

    def _commit(self) -> None:
        self.db.execute("COMMIT")

    def _rollback(self) -> None:
        if self.db.in_transaction:
            with contextlib.suppress(sqlite3.Error):  # tried again before the next BEGIN
                self.db.execute("ROLLBACK")

    def _translate(self, e: Exception) -> StoreUnavailable | None:
        """sqlite3's errors of the file system as StoreUnavailable, saying which one to fix."""
        if not isinstance(e, sqlite3.Error) or not _unavailable(e):
            return None
        return StoreUnavailable(
            f"the coordinator cannot use its database {self.path}: {e}",
            action=f"free space on (or repair) the file system that holds {self.path}, then send this "
                   "request again; the coordinator keeps trying by itself: an evacuation it cannot record "
                   "is undone on the agents, and written down once the database takes writes again",
            details={"database": str(self.path), "sqlite_error": getattr(e, "sqlite_errorname", str(e))})

    def columns(self, table: str) -> set[str]:
        return {r["name"] for r in self.db.execute(f"PRAGMA table_info({table})")}

    def _schema_version(self) -> int:
        return int(self.db.execute("PRAGMA user_version").fetchone()[0])

    def _set_schema_version(self, version: int) -> None:
        self.db.execute(f"PRAGMA user_version={int(version)}")

"""The coordinator's records on PostgreSQL (psycopg 3): the store several coordinators share, one of
them leading (coordinator/leadership.py), on a database that outlives any coordinator's host.

The same schema, SQL and migrations as SQLite's (coordinator/store.py); what differs is here: one
connection in autocommit mode with explicit transactions, made again after the server restarted
or the link broke (the statement that met the break fails as StoreUnavailable, as a full disk does
on SQLite: the driver then undoes what it can no longer record, and the next call reconnects);
the schema's version in a table of its own; migrations of coordinators starting at once taken in
turn under an advisory lock; the lease timed by the server's clock, so that coordinators on hosts
whose clocks differ agree on when it expires.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import errors as pgerrors
from psycopg.rows import dict_row

from pitstop.coordinator.store import BaseStore, Row, StoreUnavailable
from pitstop.coordinator.timeouts import PG_CONNECT_TIMEOUT_S, PG_STATEMENT_TIMEOUT_MS

# TCP keepalives and the kernel's limit on unacknowledged data: a server that vanished (its host
# powered off, the link cut) is found out in seconds, not after the kernel's 15 minutes of retries.
KEEPALIVE = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3,
             "tcp_user_timeout": 10000}
MIGRATION_LOCK = 0x70697473  # "pits": the advisory lock under which one coordinator at a time migrates

# Failures of the server or of the link, not of pitstop's SQL: they pass once the server is back.
_TRANSIENT: tuple[type[Exception], ...] = (
    psycopg.OperationalError, psycopg.InterfaceError, pgerrors.SerializationFailure, pgerrors.DeadlockDetected,
    pgerrors.DiskFull, pgerrors.OutOfMemory, pgerrors.TooManyConnections, pgerrors.QueryCanceled,
    pgerrors.LockNotAvailable, pgerrors.ReadOnlySqlTransaction)


def redact(url: str) -> str:
    """The URL without its password: what logs, errors and `pitstop doctor` may show."""
    try:
        u = urlsplit(url)
        port = f":{u.port}" if u.port else ""
    except ValueError:
        return "postgresql://(unreadable URL)"
    user = f"{u.username}@" if u.username else ""
    return f"postgresql://{user}{u.hostname or ''}{port}{u.path}"


class PostgresStore(BaseStore):
    GREATEST = "GREATEST"

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.where = redact(url)
        self.conn: psycopg.Connection[Any] | None = None
        self._sql: dict[str, str] = {}
        self._open()

    # -- the connection -----------------------------------------------------------------------
    def _conn(self) -> psycopg.Connection[Any]:
        c = self.conn
        if c is None or c.closed or c.broken:
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()
            self.conn = None
            c = psycopg.connect(self.url, autocommit=True, row_factory=dict_row, connect_timeout=PG_CONNECT_TIMEOUT_S,
                                options=f"-c statement_timeout={PG_STATEMENT_TIMEOUT_MS}",
                                application_name="pitstop-coordinator", **KEEPALIVE)  # type: ignore[arg-type]
            self.conn = c
        return c

    def close(self) -> None:
        with self.lock:
            if self.conn is not None:
                with contextlib.suppress(Exception):
                    self.conn.close()
                self.conn = None

    def _pg(self, sql: str) -> str:
        """SQLite's `?` placeholders as psycopg's `%s` (no statement here holds a literal ? or %)."""
        out = self._sql.get(sql)
        if out is None:
            out = self._sql[sql] = sql.replace("?", "%s")
        return out

    def _execute(self, sql: str, args: tuple = ()) -> list[Row]:
        cur = self._conn().execute(self._pg(sql), args or None)
        return cur.fetchall() if cur.description else []

    def _executemany(self, sql: str, rows: list[tuple]) -> None:
        with self._conn().cursor() as cur:
            cur.executemany(self._pg(sql), rows)

    def _begin(self) -> None:
        c = self._conn()
        if c.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            c.execute("ROLLBACK")  # one a failed ROLLBACK left open: nothing of it is ours
        c.execute("BEGIN")

    def _commit(self) -> None:
        self._conn().execute("COMMIT")

    def _rollback(self) -> None:
        c = self.conn
        if c is None or c.closed or c.broken:
            return  # the server ended the transaction with the connection
        try:
            if c.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                c.execute("ROLLBACK")
        except psycopg.Error:
            with contextlib.suppress(Exception):
                c.close()
            self.conn = None

    def _translate(self, e: Exception) -> StoreUnavailable | None:
        if not isinstance(e, _TRANSIENT):
            return None
        if self.conn is not None and (self.conn.closed or self.conn.broken):
            self.conn = None  # made again by the next statement
        sqlstate = getattr(getattr(e, "diag", None), "sqlstate", None)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return StoreUnavailable(
            f"the coordinator cannot use its database {self.where}: {first}",
            action=f"check that the PostgreSQL server of {self.where} runs and that this host reaches it (and, "
                   "where it says so, that its disk has room); the coordinator reconnects by itself: an "
                   "evacuation it cannot record is undone on the agents, and written down once the database "
                   "takes writes again",
            details={"database": self.where, "postgresql_error": sqlstate or type(e).__name__})

    # -- schema ---------------------------------------------------------------------------------
    def columns(self, table: str) -> set[str]:
        return {r["name"] for r in self._execute(
            "SELECT column_name AS name FROM information_schema.columns WHERE table_name=? "
            "AND table_schema=current_schema()", (table,))}

    def _schema_version(self) -> int:
        self._execute("CREATE TABLE IF NOT EXISTS schema_version (id BIGINT PRIMARY KEY, version BIGINT NOT NULL)")
        self._execute("INSERT INTO schema_version(id, version) VALUES(1, 0) ON CONFLICT(id) DO NOTHING")
        return int(self._execute("SELECT version FROM schema_version WHERE id=1")[0]["version"])

    def _set_schema_version(self, version: int) -> None:
        self._execute("UPDATE schema_version SET version=? WHERE id=1", (version,))

    @contextlib.contextmanager
    def _migration_lock(self) -> Iterator[None]:
        """Coordinators started at once on a new (or older) database: one creates and migrates, the
        others wait, then find it done."""
        self._execute("SELECT pg_advisory_lock(?)", (MIGRATION_LOCK,))
        try:
            yield
        finally:
            with contextlib.suppress(psycopg.Error):
                self._execute("SELECT pg_advisory_unlock(?)", (MIGRATION_LOCK,))

    def _now_sql(self) -> tuple[str, tuple]:
        return "CAST(extract(epoch FROM clock_timestamp()) AS DOUBLE PRECISION)", ()

    def _share_lock(self) -> str:
        return " FOR SHARE"

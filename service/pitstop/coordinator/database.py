"""Which database holds the coordinator's records, by the URL given to --db (PITSTOP_COORDINATOR_DB).

    /var/lib/pitstop/coordinator.db            SQLite, a path (the default; `make demo`)
    sqlite:///var/lib/pitstop/coordinator.db   SQLite, as a URL (the path after `sqlite://`)
    postgresql://USER[:PASSWORD]@HOST[:PORT]/DB PostgreSQL (also postgres://; libpq's parameters
                                               after `?`, e.g. sslmode=verify-full)

SQLite is one coordinator on one host.  PostgreSQL is what two or more coordinators share, one of
them leading (coordinator/leadership.py).  A URL of another kind stops the coordinator at start,
saying which kinds there are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator

from pitstop.coordinator.sqlitestore import Store
from pitstop.coordinator.store import BaseStore

Kind = Literal["sqlite", "postgresql"]


def parse(db: str | Path) -> tuple[Kind, str]:
    """(kind, what to open: a path or the PostgreSQL URL); ValueError saying what is wrong."""
    text = str(db).strip()
    if not text:
        raise ValueError("no database given")
    if text.startswith(("postgresql://", "postgres://")):
        return "postgresql", text
    if text.startswith("sqlite://"):
        path = text[len("sqlite://"):]
        if not path.startswith("/"):
            raise ValueError(f"{text!r}: a SQLite URL names an absolute path, sqlite:///var/lib/pitstop/coordinator.db")
        return "sqlite", "/" + path.lstrip("/")
    if "://" in text:
        raise ValueError(f"{text!r} is neither a SQLite path (or sqlite:///PATH) nor a postgresql:// URL")
    return "sqlite", text


def _check(value: str) -> str:
    parse(value)
    return value


DatabaseURL = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, Path) else v), AfterValidator(_check)]
"""A settings field: a path or URL, checked as the settings load (a typo stops the service at start)."""


def shared(db: str | Path) -> bool:
    """Whether several coordinators can share this database (PostgreSQL)."""
    return parse(db)[0] == "postgresql"


def open_store(db: str | Path) -> BaseStore:
    kind, target = parse(db)
    if kind == "postgresql":
        from pitstop.coordinator.pgstore import PostgresStore  # psycopg only where PostgreSQL is used

        return PostgresStore(target)
    return Store(Path(target))


def describe(db: str | Path) -> str:
    """The database as logs and `pitstop doctor` may show it (a PostgreSQL URL without its password)."""
    kind, target = parse(db)
    if kind == "postgresql":
        from pitstop.coordinator.pgstore import redact

        return redact(target)
    return target

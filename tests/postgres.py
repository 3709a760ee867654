"""A real PostgreSQL for the tests whose subject it is: Debian's server, installed if missing by
scripts/provision-postgresql.sh (as tests/slurm_cluster.py provisions Slurm), started once per test
session from a temporary directory (pitstop.dev.devpostgres), a database of its own per test.

Skipped, saying why, only where the package cannot be installed (no root, no apt, no archive);
never in CI (CI=1), where a missing PostgreSQL fails the tests instead.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def provision() -> None:
    p = subprocess.run([str(ROOT / "scripts" / "provision-postgresql.sh")], capture_output=True, text=True,
                       timeout=900)
    if p.returncode != 0:
        why = (p.stderr or p.stdout).strip().splitlines()[-1:] or [f"exit {p.returncode}"]
        if os.environ.get("CI"):
            raise RuntimeError(f"scripts/provision-postgresql.sh failed: {why[0]}")
        pytest.skip(f"PostgreSQL cannot be installed here ({why[0]})")


@pytest.fixture(scope="session")
def postgres() -> Iterator["PrivatePostgres"]:  # noqa: F821 - imported below, after provisioning
    """One private server for the session (about 3 s to make and start)."""
    provision()
    from pitstop.dev.devpostgres import PrivatePostgres

    pg = PrivatePostgres()
    try:
        yield pg
    finally:
        pg.close()


@pytest.fixture
def pg_url(postgres) -> Iterator[str]:  # noqa: ANN001
    """A new empty database on the session's server, dropped after the test."""
    url = postgres.create_database()
    try:
        yield url
    finally:
        postgres.drop_database(url)

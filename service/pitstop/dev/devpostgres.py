"""A private PostgreSQL server for the tests and benches whose subject it is (the coordinator's
store on PostgreSQL, its leadership, a database restarted under it).

Debian's server (scripts/provision-postgresql.sh installs it where it is missing), run from a
temporary directory: initdb as an unprivileged user (PostgreSQL refuses to run as root), the
server on a free port of 127.0.0.1 with its socket in that directory, trust authentication on
loopback only.  The package's own cluster and service are never touched.  `close()` stops the
server and removes the directory; a run killed before that leaves a lease (dev/devleases.py) that
the next local cluster or server sweeps.
"""

from __future__ import annotations

import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from pitstop.dev import devleases
from pitstop.dev.devcluster import free_port
from pitstop.errors import FailedPrecondition

START_TIMEOUT_S = 60.0
USER = "pitstop"  # the database role the tests connect as (a superuser of this private server)


def binaries() -> Path:
    """The directory holding initdb and postgres: the newest /usr/lib/postgresql/N/bin (Debian keeps
    them out of PATH), else PATH's."""
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name)
                  if Path(d).parent.name.isdigit() else 0)
    for d in reversed(dirs):
        if os.access(f"{d}/initdb", os.X_OK) and os.access(f"{d}/postgres", os.X_OK):
            return Path(d)
    initdb, postgres = shutil.which("initdb"), shutil.which("postgres")
    if initdb and postgres:
        return Path(initdb).resolve().parent
    raise FailedPrecondition("PostgreSQL's server (initdb, postgres) is not installed", code="no_postgresql",
                             action="run scripts/provision-postgresql.sh as root (Debian's postgresql package)")


def _server_user() -> pwd.struct_passwd:
    """Who runs the server: the package's `postgres` user, else `nobody` (not root: it refuses)."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid())
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise FailedPrecondition("no unprivileged user to run PostgreSQL as", code="no_postgresql_user",
                             action="create the `postgres` user (Debian's postgresql package does)")


class PrivatePostgres:
    """One server, its own directory and port; databases made and dropped per test."""

    def __init__(self, durable: bool = False) -> None:
        """durable: fsync and synchronous commit as a real install has them (benches); off by
        default, for tests, where a crash of the machine loses nothing anyone keeps."""
        self.bin = binaries()
        self.user = _server_user()
        self.lease = "postgres-" + secrets.token_hex(6)
        for line in devleases.sweep():
            print(f"pitstop devpostgres: {line}", flush=True)
        self.dir = Path(tempfile.mkdtemp(prefix="pitstop-pg-"))
        devleases.take(self.lease, marker=self.lease, paths=[str(self.dir)])
        self.data = self.dir / "data"
        self.log = self.dir / "postgres.log"
        self.port = free_port()
        self.durable = durable
        self.proc: subprocess.Popen | None = None
        try:
            os.chown(self.dir, self.user.pw_uid, self.user.pw_gid)
            self._run([str(self.bin / "initdb"), "-D", str(self.data), "-U", USER, "-A", "trust", "--no-locale",
                       "-E", "UTF8", *(["--no-sync"] if not durable else [])])
            self.start()
        except BaseException:
            self.close()
            raise

    def _env(self) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", devleases.MARKER: self.lease}

    def _run(self, args: list[str]) -> None:
        p = subprocess.run(args, user=self.user.pw_uid, group=self.user.pw_gid, env=self._env(), cwd=self.dir,
                           capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr[-1500:] or p.stdout[-1500:]}")

    def start(self) -> None:
        """Start the server (again, after stop()) on the same port and data, and wait until it takes
        connections."""
        opts = ["-c", "listen_addresses=127.0.0.1", "-c", f"port={self.port}",
                "-c", f"unix_socket_directories={self.dir}", "-c", "max_connections=200"]
        if not self.durable:
            opts += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        log = open(self.log, "ab")
        try:
            self.proc = subprocess.Popen([str(self.bin / "postgres"), "-D", str(self.data), *opts],
                                         user=self.user.pw_uid, group=self.user.pw_gid, env=self._env(),
                                         cwd=self.dir, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        finally:
            log.close()
        self._wait_ready()

    def _wait_ready(self) -> None:
        import psycopg

        end = time.monotonic() + START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                with psycopg.connect(self.url("postgres"), connect_timeout=2):
                    return
            except psycopg.OperationalError as e:
                last = e
                time.sleep(0.1)
        raise TimeoutError(f"PostgreSQL did not take connections within {START_TIMEOUT_S:g} s ({last}):\n"
                           f"{self.logs()}")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: fast (SIGINT: connections ended, a clean shutdown) or immediate
        (SIGQUIT: as a crash, recovered from the WAL at the next start)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT if mode == "fast" else signal.SIGQUIT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def restart(self, mode: str = "fast", down_s: float = 0.0) -> None:
        self.stop(mode)
        time.sleep(down_s)
        self.start()

    def url(self, database: str) -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = name or "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url("postgres"), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def drop_database(self, url: str) -> None:
        import psycopg

        name = url.rsplit("/", 1)[1]
        with psycopg.connect(self.url("postgres"), autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def logs(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else "(no log)"

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        devleases.drop(self.lease)
